"""The scale benchmark's measurements that are not peer launches: the disk, recovery, memory, the plots."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from benchmarks import baselines
from benchmarks.common import Workload, config_overrides, load, median, run_elastictrain
from benchmarks.recovery import _elastictrain_outcome
from benchmarks.reshard import disk_bandwidth
from benchmarks.throughput import step_times

MODES = ("none", "cpu", "nvme")


def remove_folders(*paths: Path) -> None:
    """Folders a part has read what it needs from (at 1B its checkpoints fill the disk otherwise)."""
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def cold_disk_bandwidth(folder: Path, size: int) -> dict[str, float]:
    """Sequential write + fsync, then a read from a dropped page cache, of `size` bytes (>= 256 MiB)."""
    return disk_bandwidth(folder, size, floor=256 << 20, block_bytes=64 << 20, cold=True)


def steady_step_s(records: list[dict[str, Any]], w: Workload) -> float:
    return median(step_times(records)[max(0, w.warmup_steps - 1) :])


# World sizes (min, max) of the recovery run: one worker of `max` is killed; the run goes on at max - 1
# where min allows, else with a spare. At 350M and 1B neither 3 ranks nor 1 (which holds the whole
# model's state) fit this 24 GiB machine (Ray's memory monitor killed a rank of 3 and, at 1B, the one
# rank left of 2), so those sizes stay at 2 with one warm spare (`scaling.spare_workers=1`: an actor
# with its imports and data, no model) that takes the killed worker's place.
RECOVERY_WORLD_SIZES = {"350m": (2, 2), "1b": (2, 2)}


def elastictrain_recovery(w: Workload, tmp: Path, size: str = "") -> dict[str, Any]:
    """A checkpoint at step 2, the last worker killed after step 3: kill to first step at one fewer."""
    import ray

    from elastictrain.testing.chaos import at_step, chain

    baselines.ensure_local_ray()
    t_fail: list[float] = []
    computed: list[float] = []  # every step reported: its slowest rank's own compute
    killed_after: list[int] = []  # how many steps were reported when the worker was killed

    def kill(controller: Any) -> None:
        t_fail.append(time.time())
        ray.kill(controller.active[-1].actor)
        killed_after.append(len(computed))

    def record(controller: Any) -> None:
        def after_step(_c: Any, _index: int, results: list[dict[str, Any]]) -> None:
            computed.append(max(r["step_time_s"] for r in results))

        controller.callbacks.after_step.append(after_step)

    low, high = RECOVERY_WORLD_SIZES.get(size, (2, 3))
    cfg = load(
        config_overrides(
            w,
            tmp,
            f"scaling.min_workers={low}",
            f"scaling.max_workers={high}",
            f"scaling.spare_workers={1 if low == high else 0}",
            "checkpoint.every_steps=2",
            "training.max_steps=5",
        )
    )
    run_dir = run_elastictrain(cfg, chain(record, at_step(3, kill)))
    out = _elastictrain_outcome(run_dir, t_fail[0])
    checkpoints = [e for e in run_dir.read_events() if e["event"] == "checkpoint"]
    out["checkpoint_bytes"] = checkpoints[0]["bytes"] if checkpoints else 0
    # Each step's own compute after the restart, in this run (the machine's speed varies between runs):
    # the first is the redone one; the quickest of them is the steady compute it is compared with (a
    # later one may hold a checkpoint's write, or the replacement's warm-up on these 2 cores).
    out["compute_after_restart_s"] = computed[killed_after[0] :]
    return out


def worker_allocator() -> str:
    """The malloc elastictrain's workers ran in a measured run: scaling.worker_allocator's default (the
    benchmark sets no other). Runs recorded without it predate the setting and ran the system's."""
    from elastictrain.config.schema import ScalingConfig

    return ScalingConfig().worker_allocator


def memory_modes(w: Workload, tmp: Path, preset_peak: int | None, smoke: bool) -> dict[str, Any]:
    """Peak resident memory per rank for each offload, against core.memory_estimate's estimate.

    Checkpoints are streamed and in-memory snapshots off (`checkpoint.max_host_memory_mb=0` does both),
    so the peak is training's own (the snapshots' memory is the memory_recovery benchmark's); a
    configuration elastictrain's preflight refuses is recorded with its message, not run.
    """
    from elastictrain.driver.preflight import PreflightError, check_memory_on_nodes

    baselines.ensure_local_ray()
    short = Workload(f"{w.name}-memory", w.overrides, warmup_steps=0, measured_steps=2, peer_timeout_s=3600)
    out: dict[str, Any] = {"worker_allocator": worker_allocator()}
    for mode in ("none",) if smoke else MODES:
        extra = (
            f"deepspeed.offload_optimizer={mode}",
            "deepspeed.offload_param=none",
            "checkpoint.max_host_memory_mb=0",
            "scaling.min_workers=2",
            "scaling.max_workers=2",
        )
        cfg = load(config_overrides(short, tmp / mode, *extra))
        try:
            estimate = check_memory_on_nodes(cfg)
        except PreflightError as e:
            out[mode] = {"refused": str(e)}
            continue
        try:
            run = baselines.elastictrain(2, short, tmp, 0, *extra)
        except RuntimeError as e:  # e.g. a full disk at 1B: a finding, the other modes go on
            out[mode] = {"outcome": "failed", "error": str(e)[:2000]}
            continue
        remove_folders(Path(run["run_dir"]) / "checkpoints")  # 11 GB each at 1B
        peak = max((m["peak_rss_bytes"] for m in run["memory"]), default=None)
        bound = estimate.host_bytes if estimate is not None else None
        out[mode] = {
            "peak_rss_bytes": peak,
            "bound_bytes": bound,
            "vs_bound": peak / bound if peak and bound else None,
            # The largest rank's peak once its engine was built and loaded: where the set-up, not the
            # steps, sets the peak, the two are equal.
            "setup_peak_rss_bytes": run["setup_peak_rss_bytes"],
            # What the memory costs in time: each step as the controller saw it (the first one included).
            "step_s": [round(r["step_s"], 2) for r in run["steps"] if "step_s" in r],
        }
        gib = lambda b: f"{b / 2**30:.2f} GiB" if b else "?"  # noqa: E731
        steps = out[mode]["step_s"]
        at_setup = gib(run["setup_peak_rss_bytes"])
        where = f"peak {gib(peak)} ({at_setup} by the end of set-up), bound {gib(bound)}"
        print(f"    memory {mode}: {where}, steps {steps} s", flush=True)
    return out


# ---------------------------------------------------------------- plots
def plot_scale(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [s for s, m in result["metrics"].items() if m.get("parameters")]
    if not sizes:
        return
    ms = [result["metrics"][s] for s in sizes]
    p = [m["parameters"] for m in ms]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))

    def line(ax: Any, values: list[Any], label: str, style: str = "o-") -> None:
        pts = [(x, v) for x, v in zip(p, values, strict=True) if v]
        if pts:
            ax.plot(*zip(*pts, strict=True), style, label=label)

    ax = axes[0][0]
    line(ax, [m["pause_s"] for m in ms], "elastictrain pause")
    line(ax, [m["commit_s"] for m in ms], "elastictrain commit")
    line(ax, [m["deepspeed_save_checkpoint_s"] for m in ms], "DeepSpeed save_checkpoint")
    line(
        ax,
        [m["checkpoint_bytes"] / m["disk"]["write_fsync_bytes_per_s"] for m in ms],
        "bytes / disk write bw",
        "k--",
    )
    ax.set_title("checkpoint (s)")
    ax = axes[0][1]
    line(ax, [m["reshard_2_to_3_s"] for m in ms], "elastictrain load 2->3")
    line(ax, [m["reshard_3_to_2_s"] for m in ms], "elastictrain load 3->2")
    line(ax, [m["universal_route_2_to_3_s"] for m in ms], "ds_to_universal + load 2->3")
    line(ax, [m["recovery_s"] for m in ms], "recovery (kill to step)")
    line(
        ax, [m["checkpoint_bytes"] / m["disk"]["read_bytes_per_s"] for m in ms], "bytes / disk read bw", "k--"
    )
    ax.set_title("resharding and recovery (s)")
    ax = axes[1][0]
    for system in ("elastictrain", "deepspeed", "ray_train"):
        line(ax, [m["cold_start_s"].get(f"{system}_s") for m in ms], f"cold start {system}")
    ax.set_title("command to first step (s)")
    ax = axes[1][1]
    for mode in MODES:
        line(ax, [(m["memory"].get(mode) or {}).get("peak_rss_bytes") for m in ms], f"peak, {mode} offload")
        line(ax, [(m["memory"].get(mode) or {}).get("bound_bytes") for m in ms], f"bound, {mode}", "x:")
    ax.set_title("host memory per rank (bytes)")
    for ax in axes.flat:
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("parameters")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
