"""How every cost grows with the model, 30M to 1B parameters (the `conf/llama-*.yaml` presets).

For each size, in one process and side by side (all figures at world size 2 unless stated):
  throughput     elastictrain's steady step against the deepspeed launcher's, same model and config,
                 neither checkpointing (elastictrain's in-memory snapshots as configured);
  cold start     command to first completed step: `elastictrain train` (a subprocess, as users run
                 it), the deepspeed launcher and Ray Train's TorchTrainer;
  checkpoint     elastictrain's pause (training stopped) and time to a committed checkpoint, against
                 DeepSpeed's save_checkpoint, elastictrain's own durable synchronous save (streamed),
                 and the disk's fsynced write bandwidth measured here;
  resharding     loading the world-size-2 checkpoint at 3 and a 3-rank one at 2, page cache dropped
                 first, against the disk's read bandwidth and `ds_to_universal` + universal load (2->3);
  recovery       a worker killed (3 -> 2 workers) to the first completed step after it;
  memory         peak resident memory per rank against core.memory_estimate's estimate (the ZeRO-3 bound plus
                 the runtime's baseline) for no offload, CPU offload and NVMe offload.
Sizes run in order and each is saved to scale.json as soon as it is done: `--sizes 30m,125m` runs
part of them, and a later run skips the sizes already there (`--redo` measures them again).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks import baselines
from benchmarks.common import (
    BIN,
    CONFIG,
    ROOT,
    Result,
    Target,
    Workload,
    config_overrides,
    median,
    peer_env,
    ratio,
    run_peer,
)
from benchmarks.scale_parts import (
    cold_disk_bandwidth,
    elastictrain_recovery,
    memory_modes,
    remove_folders,
    steady_step_s,
    worker_allocator,
)
from benchmarks.scale_reshard import reshard_loads
from benchmarks.throughput import step_times

SIZES = ("30m", "125m", "350m", "1b")
# (warm-up steps skipped, measured steps): fewer at the sizes where a CPU step takes tens of seconds.
# At 30M elastictrain's snapshot schedule measures its steps with and without a copy over the first
# ~8 steps (control/snapshot_schedule.py) before it settles: the steady state starts after them.
STEPS = {"30m": (8, 4), "125m": (2, 3), "350m": (1, 2), "1b": (1, 2), "smoke": (1, 2)}
PRESET_KEYS = ("model.hf_config", "data.seq_len", "training", "deepspeed", "failure")


def preset_overrides(size: str) -> tuple[str, ...]:
    """The preset's model, batch, DeepSpeed and timeout settings as overrides of the benchmarks' config."""
    from omegaconf import OmegaConf

    preset = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / f"llama-{size}.yaml"))
    assert isinstance(preset, dict)
    out = []
    for key in PRESET_KEYS:
        node: Any = preset
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            skip = ("max_steps", "warmup_steps")  # the benchmark's own step counts
            out += [f"{key}.{k}={'null' if v is None else v}" for k, v in node.items() if k not in skip]
        elif node is not None:
            out.append(f"{key}={node}")
    return (*out, "data.generated_chars=400000", "training.warmup_steps=1")


def workload_for(size: str, smoke: bool) -> Workload:
    warm, measured = STEPS["smoke" if smoke else size]
    return Workload(
        f"scale-{size}",
        preset_overrides(size),
        warmup_steps=warm,
        measured_steps=measured,
        peer_timeout_s=3600,
    )


def measure_size(size: str, tmp: Path, smoke: bool) -> dict[str, Any]:
    w = workload_for(size, smoke)
    tmp = tmp / size
    nvme = tmp / "nvme"
    nvme.mkdir(parents=True, exist_ok=True)
    w = Workload(w.name, (*w.overrides, f"deepspeed.nvme_path={nvme}"), *_steps(w))
    out: dict[str, Any] = {"size": size, "workload": list(w.overrides), "started": time.time()}
    log = lambda msg: print(f"  scale {size}: {msg}", flush=True)  # noqa: E731

    t0 = time.time()
    ds = baselines.peer("deepspeed", 2, w, tmp, 0)
    # The launcher's runs leave their NVMe swap files behind (elastictrain's workers remove theirs): at
    # 1B 10.6 GB that, beside the checkpoints below, fill the disk.
    remove_folders(nvme / "zero_stage_3")
    save = (ds.out or {})["save"]
    out["parameters"] = (ds.out or {}).get("parameters")
    out["deepspeed"] = {
        "step_s": steady_step_s(ds.step_records(), w),
        "cold_start_s": ds.step_records()[0]["time"] - t0,
        "save_checkpoint_s": median(save["deepspeed_save_checkpoint_s"]),
        "checkpoint_bytes": save["deepspeed_bytes"],
        "peak_rss_bytes": max(m["peak_rss_bytes"] for m in ds.out["memory"]),  # type: ignore[index]
    }
    frag_bytes = save["fragment_bytes"]
    out["elastictrain_save"] = {
        "snapshot_s": median(save["elastictrain_snapshot_s"]),
        "snapshot_and_write_s": median(save["elastictrain_save_s"]),
        "streamed_sync_save_s": median(save["elastictrain_stream_s"]),
        "bytes": frag_bytes,
    }
    log(f"{out['parameters'] / 1e6:.0f}M parameters; deepspeed step {out['deepspeed']['step_s']:.2f}s")
    out["disk"] = cold_disk_bandwidth(tmp, frag_bytes // 2)
    log(f"disk {out['disk']['write_fsync_bytes_per_s'] / 1e6:.0f} MB/s write, "
        f"{out['disk']['read_bytes_per_s'] / 1e6:.0f} MB/s read")  # fmt: skip
    # Resharding reads the launcher run's saves; they go once read. At 1B each copy is 11 GB and the
    # runs below hold up to three checkpoints and their NVMe swap files: kept all, they fill a 64 GB disk.
    try:
        out["reshard"] = reshard_loads(w, tmp, save, frag_bytes, out["deepspeed"]["peak_rss_bytes"])
    except RuntimeError as e:  # e.g. 3 ranks of 350M do not fit this machine: a finding, the rest goes on
        out["reshard"] = {"outcome": "failed", "error": str(e)[:2000], "bytes": frag_bytes}
    log(f"reshard {out['reshard']}")
    remove_folders(Path(save["fragments_dir"]).parent, tmp / "fragments.ws3", nvme / "zero_stage_3")

    out["elastictrain"] = elastictrain_checkpointing(w, tmp)
    log(f"elastictrain step {out['elastictrain']['step_s']:.2f}s, pauses {out['elastictrain']['pause_s']}")

    out["cold_start"] = {
        "elastictrain_s": elastictrain_cli_cold_start(w, tmp / "cli"),
        "deepspeed_s": out["deepspeed"]["cold_start_s"],
        "ray_train_s": ray_train_cold_start(w, tmp / "ray-train"),
    }
    log(f"cold start {out['cold_start']}")
    remove_folders(tmp / "cli", tmp / "ray-train")
    try:
        out["recovery"] = elastictrain_recovery(w, tmp / "recovery", size)
    except RuntimeError as e:  # a run that failed is a finding of its own: recorded, the other parts go on
        out["recovery"] = {"outcome": "failed", "error": str(e)[:2000]}
    log(f"recovery {out['recovery']}")
    remove_folders(tmp / "recovery")  # its checkpoints (at 1B 11 GB each) are not read again
    out["memory"] = memory_modes(w, tmp / "memory", out["elastictrain"]["peak_rss_bytes"], smoke)
    log(f"memory {out['memory']}")
    out["seconds"] = time.time() - out["started"]
    baselines.clear()
    return out


def _steps(w: Workload) -> tuple[int, int, float]:
    return w.warmup_steps, w.measured_steps, w.peer_timeout_s


def elastictrain_cli_cold_start(w: Workload, tmp: Path) -> float | None:
    """`elastictrain train` from a fresh process to its first completed step (its `step 1/` line)."""
    tmp.mkdir(parents=True, exist_ok=True)
    overrides = config_overrides(w, tmp / "run", "training.max_steps=1", "checkpoint.every_steps=1000")
    cmd = [str(BIN / "elastictrain"), "train", "-c", str(CONFIG), "--no-tracking", *overrides]
    t0 = time.time()
    first = None
    with subprocess.Popen(
        cmd, cwd=ROOT, env=peer_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if first is None and line.startswith("step 1/"):
                first = time.time() - t0
        proc.wait(timeout=w.peer_timeout_s)
    return first


def ray_train_cold_start(w: Workload, tmp: Path) -> float | None:
    one = Workload(w.name, w.overrides, warmup_steps=0, measured_steps=1, peer_timeout_s=w.peer_timeout_s)
    t0 = time.time()
    run = run_peer("ray_train", 2, one, tmp)
    steps = run.step_records()
    return steps[0]["time"] - t0 if steps else None


# ---------------------------------------------------------------- the run, the table, the plots
def run(
    w: Workload,
    tmp: Path,
    reps: int,
    smoke: bool,
    sizes: str = "",
    redo: bool = False,
    results: Path | None = None,
    parts: str = "",
) -> Result:
    """`results`: the folder of scale.json (--results): read to resume, written after each size.
    `parts` ("reshard,recovery,checkpoint"): measure those parts of measured sizes again, keeping the rest."""
    from benchmarks.common import RESULTS

    results = results or RESULTS
    wanted = [s.strip() for s in sizes.split(",") if s.strip()] or (["30m"] if smoke else list(SIZES))
    unknown = [s for s in wanted if s not in SIZES]
    if unknown:
        raise ValueError(f"--sizes: unknown size(s) {unknown}; expected any of {', '.join(SIZES)}")
    done = {} if smoke else previous_sizes(results)
    for size in wanted:
        if parts:
            from benchmarks.scale_remeasure import PARTS, remeasure

            names = [p.strip() for p in parts.split(",") if p.strip()]
            if size not in done or not set(names) <= set(PARTS):
                raise ValueError(
                    f"--parts {parts}: expected any of {', '.join(PARTS)} of a size in scale.json "
                    f"(measured: {', '.join(done) or 'none'})"
                )
            for name in names:
                found = remeasure(name, size, tmp / size)
                if name == "checkpoint":  # the checkpointing run's figures; the steady step stays the size's
                    done[size]["elastictrain"].update(found)
                elif name == "throughput":  # both sides' steady steps, measured again together
                    for side in ("deepspeed", "elastictrain"):
                        done[size][side].update(found[side])
                    done[size]["throughput_time"] = found["time"]
                else:
                    done[size][name] = found
                save_partial(done, results)
            continue
        if size in done and not redo:
            print(f"  scale {size}: measured before ({done[size].get('time', '?')}); --redo to measure again")
            continue
        measured = measure_size(size, tmp, smoke)
        measured["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        done[size] = measured
        if not smoke:
            save_partial(done, results)  # a later run resumes after the last size finished
    return summarize(done, smoke)


def previous_sizes(results: Path) -> dict[str, Any]:
    path = results / "scale.json"
    if not path.exists():
        return {}
    return {r["size"]: r for r in json.loads(path.read_text()).get("runs", [])}


def save_partial(done: dict[str, Any], results: Path) -> None:
    summarize(done, False).write(results)


def elastictrain_checkpointing(w: Workload, tmp: Path) -> dict[str, Any]:
    """elastictrain's steady step, and its step, pause and commit with checkpoints, at 2 ranks."""
    # Steady state as the launcher runs it: no checkpoint until the last step (checkpoints are measured
    # by the next run); elastictrain's in-memory snapshots as configured (the defaults).
    steady = baselines.elastictrain(2, w, tmp / "steady", 0, f"checkpoint.every_steps={w.steps}")
    remove_folders(Path(steady["run_dir"]) / "checkpoints")  # its events are read; at 1B it is 11 GB
    return {
        "step_s": steady_step_s(steady["steps"], w),
        "worker_allocator": worker_allocator(),
        **elastictrain_checkpoint_run(w, tmp),
    }


def elastictrain_checkpoint_run(w: Workload, tmp: Path) -> dict[str, Any]:
    """A run with a checkpoint mid-run, so steps follow it and its pause is seen; not every step (at 1B
    three 11 GB checkpoints and the swap files filled a 64 GB disk)."""
    every = max(2, w.steps // 2) if w.steps > 2 else 1
    et = baselines.elastictrain(2, w, tmp, 0, f"checkpoint.every_steps={every}")
    remove_folders(Path(et["run_dir"]) / "checkpoints")
    return {
        "step_s_with_checkpoints": steady_step_s(et["steps"], w),
        # Every step's interval (report to report: a pause falls in the interval after its step), to see
        # what a write beside the next step costs that step.
        "step_intervals_s": [round(t, 3) for t in step_times(et["steps"])],
        "pause_s": [p["pause_s"] for p in et["pauses"]],
        "commit_s": [c["seconds"] for c in et["checkpoints"]],
        "checkpoint_bytes": [c.get("bytes") for c in et["checkpoints"]],
        # How each rank file was written (a copy written in the background, or streamed), as the event says.
        "written": [c["message"].partition("after its step (")[2].split(")")[0] for c in et["checkpoints"]],
        "peak_rss_bytes": max((m["peak_rss_bytes"] for m in et["memory"]), default=None),
        "setup_s": et["setup_s"],
    }


def _sum_or_none(*parts: float | None) -> float | None:
    """A route's total time, or None (not NaN: the JSON stays standard) where a part did not run."""
    return None if any(p is None for p in parts) else sum(p for p in parts if p is not None)


def summarize(done: dict[str, Any], smoke: bool) -> Result:
    rows = [done[s] for s in SIZES if s in done]
    metrics: dict[str, Any] = {}
    targets: list[Target] = []
    for r in rows:
        m = size_metrics(r)
        metrics[r["size"]] = m
        targets += size_targets(r["size"], m)
    notes = [
        "pause: training stopped for the checkpoint (slowest rank); durable synchronous save: elastictrain's "
        "own streamed save (background_write: false); commit bandwidth: checkpoint bytes / time to commit.",
        "reshard and recovery loads read from a cold page cache (POSIX_FADV_DONTNEED on every file first).",
        "reshard loads where 3 ranks of the size do not fit this machine's memory (350M without offload) "
        "run with the optimizer state on NVMe (load_offload_optimizer); DeepSpeed's universal load does "
        "not handle that, so the universal route is converted but not loaded there.",
        "memory bound: core.memory_estimate.estimate_rank_memory (ZeRO-3 model states / world size + largest "
        "layer + runtime baseline); 'refused' means elastictrain's preflight refused the configuration.",
        "malloc: the deepspeed launcher's ranks run glibc's, as it starts them; elastictrain's workers run "
        "scaling.worker_allocator's default (jemalloc since 2026-11-25, glibc's before). Throughput and "
        "steady-step peaks per size ran elastictrain on: "
        + ", ".join(f"{r['size']} {r['elastictrain'].get('worker_allocator', 'system')}" for r in rows)
        + "; the memory part on: "
        + ", ".join(f"{r['size']} {r.get('memory', {}).get('worker_allocator', 'system')}" for r in rows)
        + ".",
    ]
    return Result("scale", smoke, 1, metrics, targets, rows, notes, {"sizes": [r["size"] for r in rows]})


def size_metrics(r: dict[str, Any]) -> dict[str, Any]:
    et, ds, disk, rs = r["elastictrain"], r["deepspeed"], r["disk"], r["reshard"]
    read_bw = rs.get("disk", disk)["read_bytes_per_s"]  # a reshard re-measured apart carries its disk's
    sync_save = r["elastictrain_save"]["streamed_sync_save_s"]
    commit = median(et["commit_s"])
    ck_bytes = median([b for b in et["checkpoint_bytes"] if b])
    return {
        "parameters": r["parameters"],
        "throughput_vs_deepspeed": ratio(ds["step_s"], et["step_s"]),
        "cold_start_s": r["cold_start"],
        "pause_s": median(et["pause_s"]),
        "pause_vs_durable_sync_save": ratio(median(et["pause_s"]), sync_save),
        "commit_s": commit,
        "commit_vs_disk_write": ratio(ratio(ck_bytes, commit), disk["write_fsync_bytes_per_s"]),
        "deepspeed_save_checkpoint_s": ds["save_checkpoint_s"],
        "checkpoint_bytes": ck_bytes,
        "reshard_2_to_3_vs_disk_read": ratio(ratio(rs["bytes"], rs.get("load_2_to_3_s")), read_bw),
        "reshard_3_to_2_vs_disk_read": ratio(ratio(rs["bytes"], rs.get("load_3_to_2_s")), read_bw),
        "reshard_2_to_3_s": rs.get("load_2_to_3_s"),
        "reshard_3_to_2_s": rs.get("load_3_to_2_s"),
        "reshard_error": rs.get("error"),
        "universal_route_2_to_3_s": _sum_or_none(
            rs.get("ds_to_universal_s"), rs.get("universal_load_2_to_3_s")
        ),
        "recovery_s": r["recovery"].get("death_to_first_step_s"),
        "recovery_fixed_s": _fixed_part(r),
        "recovery_error": r["recovery"].get("error"),
        "memory": r["memory"],
        "disk": disk,
    }


def _fixed_part(r: dict[str, Any]) -> float | None:
    """Recovery minus what its checkpoint's bytes may take and minus the redone steps' own compute.

    The target is a fixed part under 3 s plus the bytes read at half the disk's read bandwidth or
    better. Recovery is timed from the kill to the first completed step, and that step is one lost with
    the worker (trained again from the checkpoint): its compute (the quickest step's after the restart
    in the same run; 1-75 s a step on this CPU, growing with the model) is training, not
    recovery, so it is taken out; what remains is detection, the restart and the load, and the first
    step's extra time over a steady one.
    """
    rec = r["recovery"].get("death_to_first_step_s")
    if rec is None:
        return None
    after = r["recovery"].get("compute_after_restart_s")
    step_s = min(after) if after else r["elastictrain"]["step_s"]  # the same run's quickest, where kept
    redone = r["recovery"].get("steps_lost", 0) * step_s
    return rec - r["recovery"].get("checkpoint_bytes", 0) / (0.5 * r["disk"]["read_bytes_per_s"]) - redone


def size_targets(size: str, m: dict[str, Any]) -> list[Target]:
    out = [
        Target(f"{size}: throughput / deepspeed launcher", m["throughput_vs_deepspeed"], 0.97, ">="),
        Target(
            f"{size}: checkpoint pause / durable synchronous save",
            m["pause_vs_durable_sync_save"],
            0.05,
            "<=",
        ),
        Target(f"{size}: commit bandwidth / disk write bandwidth", m["commit_vs_disk_write"], 0.5, ">="),
        Target(
            f"{size}: reshard 2->3 load / disk read bandwidth",
            m["reshard_2_to_3_vs_disk_read"],
            0.5,
            ">=",
            note=f"the load failed: {m['reshard_error'][:300]}" if m.get("reshard_error") else "",
        ),
        Target(
            f"{size}: reshard 3->2 load / disk read bandwidth", m["reshard_3_to_2_vs_disk_read"], 0.5, ">="
        ),
        Target(
            f"{size}: recovery, fixed part (redone step's compute excluded)",
            m["recovery_fixed_s"],
            3.0,
            "<=",
            unit="s",
            note=f"the run failed: {m['recovery_error'][:300]}" if m.get("recovery_error") else "",
        ),
    ]
    for mode, mem in (m.get("memory") or {}).items():
        if isinstance(mem, dict) and mem.get("vs_bound") is not None:
            out.append(Target(f"{size}: peak memory / bound ({mode} offload)", mem["vs_bound"], 1.10, "<="))
    return out


def plot(result: dict[str, Any], out: Path) -> None:
    from benchmarks.scale_parts import plot_scale

    plot_scale(result, out)
