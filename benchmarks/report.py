"""BENCHMARKS.md from the JSON results: machine, versions, repetitions, the target table and the medians."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from benchmarks.validity import Verdict, judge


def _fmt(v: Any, unit: str = "") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    s = (f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}") if isinstance(v, float) else str(v)
    return f"{s}{' ' + unit if unit and unit != 'x' else ('x' if unit == 'x' else '')}"


def _verdict(t: dict[str, Any]) -> Verdict:
    """Judged again from the figure, so results stored before a rule changed are reported by today's rules."""
    return judge(t["name"], t["value"], t["target"], t["direction"])


def _status(t: dict[str, Any]) -> str:
    verdict = _verdict(t)
    if verdict.invalid:
        return "**invalid measurement** (negative; why below)"
    if verdict.met is None:
        return "not measured"
    if verdict.met:
        return "met"
    by = verdict.missed_by
    if by is None:
        return "missed"
    return f"missed by {by * 100:.1f}%" if by < 0.01 else f"missed by {by * 100:.0f}%"  # never "by 0%"


# Why a target can be missed and what would close it: shown under the table for each missed row.
WHY = {
    # The scale benchmark's rows first: its names also contain the generic keys below.
    "throughput / deepspeed launcher": "the in-memory snapshots' copies and replicas compete with the 2 "
    "ranks for the 2 cores. The schedule charges each snapshot the CPU time its copy, its replica's sending "
    "and the buddy's keeping of it take (0.40-0.46 s at 30M, reported by the workers) and spaces them out "
    "to stay within 3% of training time (every 5-6 steps at 30M: 0.98x of the launcher in this run). At "
    "125M the snapshots are turned off for lack of memory after their first copy, and the steps measured "
    "are few (3 steps of 9-14 s that vary by 20% between single runs). Closing it: idle cores or a GPU "
    "(the copy is a device-to-host transfer on its own stream), and more measured steps at the larger sizes.",
    "peak memory / bound": "the memory runs have no in-memory snapshots (checkpoint.max_host_memory_mb=0 "
    "turns them off) and stream their checkpoints. The workers run Ray's jemalloc with purging off "
    "(scaling.worker_allocator's default: a step reuses the pages the last one freed, where glibc's "
    "malloc kept up to twice the bound), and a ZeRO-3 fp32 rank keeps one copy of its partition and, with"
    " the optimizer offloaded, of its gradients (compat/deepspeed/zero3_memory.py). Without offload and "
    "with CPU "
    "offload the peak is then 2-10% over the bound at every size, and below the deepspeed launcher's "
    "ranks on the same model (deepspeed.peak_rss_bytes in scale.json; they run glibc's malloc and "
    "DeepSpeed's copies). With the optimizer on NVMe the build used to pass the bound (125M 1.26x, 350M "
    "1.31x, 1B 1.24x): DeepSpeed's build kept the per-parameter partitions it had flattened beside the swap "
    "buffers, read and rewrote every sub-group, and CPU Adam created its moments at the first step beside "
    "swap buffers with room for them. The worker now returns the freed partitions, skips the rewrite and "
    "creates a fresh engine's moments in the swap buffers (compat/deepspeed/zero3_build.py, "
    "zero3_memory.py); the "
    "estimate counts the swap buffers at DeepSpeed's largest sub-group (64M elements at 1B, not 50M) and "
    "the largest layer's whole gradient beside its weights (DeepSpeed's 4 bytes are fp16's 2 + 2; 8 in "
    "fp32). What is left over the bound is the step's transients (activations, the logits).",
    "steps lost per failure, the most": "the snapshot schedule spaced the snapshots out: on CPU workers it "
    "compares steps beside a snapshot's copy with probe steps that have none, and on this workload (2.8M "
    "parameters over 3 ranks on 2 cores) a snapshot cost the slowest rank 0.041 s of a 0.435 s step, 9.5% "
    "(the lower 95% bound of 8 comparisons; seen in a shorter, 400-step run of this workload whose events "
    "were read, as this 15-minute run's were not kept), over the 3% of checkpoint.memory_max_step_share, so"
    " it moved to every 4 steps at step 89, and a failure loses the steps since the last snapshot. The run "
    "before that measure existed (snapshots every step, charged only their copies' CPU time) lost at most 1"
    " step in each of its 10 failures, at 0.985 goodput. The next run's note lists the schedule's moves "
    "(GOODPUT_MINUTES=3 for a short one). Closing it: a "
    "cheaper snapshot (the copy and its replica's Ray call share the 2 cores with 3 training ranks; a "
    "buddy on the same machine could take it through shared memory), or idle cores (a GPU's copy is a "
    "device-to-host transfer on its own stream).",
    "survivors stopped by a grow": "nine of the ten grows stopped the survivors 0.52-0.68 s (the process "
    "group, the engine at the new size and the state loaded from the survivors' memory); one took 1.6 s, "
    "its memory load 1.2 s instead of 0.2 s, and a shrink's load earlier in the run was as slow once (1.1 "
    "s). The load asks the snapshot holders for their pieces with one actor call each. Both slow loads came "
    "right after a worker was killed (the shrink then, and the grow that brought its replacement in), but "
    "not after every kill. Each rank's load time, and its time asking the holders, are in attempt_started "
    "since (load_s_by_rank, load_fetch_s_by_rank): a later run on this workload caught one such grow, where "
    "one survivor waited 1.05 s on its holders while the new rank asked the same ones in 0.07 s; the cause "
    "behind that wait is not found yet.",
    "throughput": "elastictrain's driver reports every step and queues at most two steps per actor "
    "(PIPELINE_DEPTH in control/pipeline.py); a slower driver or a busier machine shows here. Closing "
    "it: deeper pipelining, or reporting every k steps.",
    "checkpoint stall": "training waits only for each rank's host-memory snapshot (elastictrain_snapshot_s, "
    "a few ms); the fsynced write runs in a background thread. The rest of the measured pause is the "
    "actor switching from its step to the snapshot and back on a 2-core machine where 2 ranks, the "
    "driver and the writer thread share the cores, and the denominator is a 33 MB save into the page "
    "cache. Closing it: a writer that holds no GIL (a separate process reading pinned host memory) and "
    "idle cores; with larger models DeepSpeed's save grows with the bytes while the pause is a memcpy.",
    "worker killed: recovery": "elastictrain recovers on warm survivors (process group and engine rebuilt "
    "in the same actors); what remains is detection, the rendezvous, the engine build and the load. If "
    "Ray Train is the one that did not recover, the ratio is not measured.",
    "worker killed: steps lost": "steps lost are bounded by checkpoint.every_steps, the same for every "
    "system here: each resumes from its last checkpoint. Closing it: elastictrain's checkpoint pause is a "
    "few percent of a step, so a run can checkpoint every step or two (checkpoint.every_steps) at "
    "little cost; the benchmark keeps the intervals equal to compare recovery itself.",
    "memory recovery: kill to first step": "both paths rebuild the engine on the warm survivor; loading "
    "itself takes milliseconds on this model either way (restart_load_s in the runs), so the figure is "
    "detection, teardown and the engine build, which vary by seconds between single runs on a loaded "
    "2-core machine. Closing it: repetitions (--reps) on an idle machine; with larger models the disk "
    "path's read and sha256 check grow with the bytes while the memory path reads from the survivors.",
    "memory recovery: per-step cost of snapshots and replication": "2 ranks, the driver and the "
    "buddies' replica threads share 2 cores, so the copy has no idle core to overlap with, and single "
    "runs' step times vary by 20% and more under the shared load. The CPU-time figure isolates the copy. "
    "Closing it: idle cores (on GPU machines the copy is a device-to-host transfer), or "
    "checkpoint.memory_every_steps=2 or more.",
    "memory recovery: per-step cost of a snapshot, beside": "measured within one run (a snapshot every "
    "other step), so the machine's drift between runs cancels, but not the scatter of single steps on 2 "
    "shared cores, which is larger than the figure: 4.2% and 4.0% with the replica as a Ray call, 2.2% "
    "over a socket, 5.6% with the buffers reused (2026-11-28), where the copy took 8 ms and the replica "
    "23 ms of a 0.51 s step. What a snapshot costs is moving the bytes: each rank's 24.8 MB slice is "
    "copied three times a step (into the buffer of the snapshot it replaces, into the kernel's socket "
    "buffer, into the buddy's buffer) on threads that share the 2 cores and their memory bandwidth with "
    "the 2 training ranks (the memory_presets benchmark measures the same at 30M and 125M). The schedule "
    "keeps every step here: its measured cost is under its 1.5x margin over the 3% share. Closing it: "
    "repetitions (--reps), or idle cores (on a GPU machine the copy is a device-to-host transfer and the "
    "replica uses the network).",
    "30m: per-step cost of a snapshot": "each rank's slice is 190 MB (31.7M parameters: fp32 weights and "
    "two Adam moments, over 2 ranks); a copy takes 0.06-0.1 s and sending its replica 0.2-0.23 s of a "
    "2.5-2.7 s step, on threads that share the 2 cores and their memory bandwidth with the 2 training "
    "ranks. The figure scatters between runs: 9.5%, 10.0%, 12.0% and 5.8% in four with the replica as a "
    "Ray call, 9.4% over a socket, 8.3% with the buffers reused (2026-11-28). Each step moves each rank's "
    "190 MB three times (the copy, into the kernel's socket buffer, out of it into the buddy's buffer): "
    "about 0.3 CPU s a step for both ranks, against 5.4 CPU s of training on the 2 cores, which have no "
    "idle time to absorb it; 3% is below what moving these bytes over loopback TCP costs here. The "
    "default schedule kept a snapshot every step in the 130-step kill run: the copies' CPU time was "
    "3.3-3.9% of a step (under its 4.5% margin), and its wall measure (each probe step, whose copy "
    "waits for its update, against the steps beside a copy around it) had 9 comparisons by step 110, "
    "too few to resolve a 6-12% cost among steps that scatter this much; a longer run gathers more (one "
    "per 10 marked steps). Closing it: idle cores (on a GPU machine the copy is a device-to-host "
    "transfer and the replica uses the network), or a replica sent in pieces at a lower priority than "
    "training.",
    "125m at default settings: steps lost": "in-memory snapshots were off: the buffers a worker holds "
    "(6 x 767 MiB at world size 2: its last two snapshots and the one being copied, two replicas of its "
    "buddy's and the one arriving) did not fit the memory checkpointing may use on this 23 GB machine "
    "(half the available memory split between the node's ranks, 4510-4697 MiB in earlier runs), so the "
    "kill recovered from the disk checkpoint. Closing it: checkpoint.max_host_memory_mb where the host "
    "has the room (GPU nodes hold hundreds of GB).",
    "125m: per-step cost of a snapshot": "not measured: the memory check turned in-memory snapshots off "
    "in the paired run (a result from before 2026-11-28 did not record why). Its 6 buffers of 767 MiB "
    "(4602 MiB) are at the edge of the "
    "4510-4697 MiB that half this 23 GB machine's available memory gives a rank, so whether they fit "
    "depends on the moment of the first copy: in the kill run of 2026-11-28 they did (1 step lost, from "
    "memory), in the paired run after it they did not.",
    "memory recovery: per-step cost with the default schedule": "this short run keeps a snapshot every "
    "step (the schedule moves only after a window of 20 snapshots, and only once they cost 1.5 times the "
    "allowed share), so the figure is the every-step cost, measured on single runs whose step times "
    "move by more than the 3% to be resolved (two runs at the same settings here differ by 7 points). "
    "The copy's CPU time, which does not move with load, is the figure below. Closing it: repetitions "
    "(--reps) on an idle machine.",
    "memory recovery: per-step CPU cost": "the copy is one memcpy per flat group and field, from the "
    "third copy of an attempt on into the buffer of the snapshot it replaces (snapshots/store.py): 7 ms of "
    "a step's 1.03 CPU s (0.7%) in the run of 2026-11-28. The figure compares the median CPU time of "
    "5-step blocks with copies against blocks without (a new engine each block) and scatters by more than "
    "the copy costs: -0.2%, 3.0%, 2.9% and 7.9% in four runs. Closing it: more blocks (--reps).",
    "goodput": "after a worker or node is lost the run goes on at the smaller world size until a "
    "replacement is warm (a cold start of the actor: tens of seconds on 2 cores), then grows at the "
    "next step from memory; a node added back costs the same wait. Closing it: keep spare warm actors.",
    "reshard": "the universal route pays a conversion subprocess; elastictrain reads each rank's slices "
    "directly. A miss would mean reading the fragment files is slower than the disk allows.",
    "checkpoint pause / durable": "the checkpoint's host copy runs in a thread beside the next step's "
    "forward and backward, whose update waits for it (the in-memory snapshot's copy where snapshots are "
    "on, 30M; a copy for the checkpoint alone where they do not fit, 125M): the pause is bookkeeping "
    "plus any wait of that update. A copy larger than the memory checkpoints may use (half the memory "
    "available, split between the node's ranks) is not made: the file is streamed from the live state, "
    "also beside the next step's forward and backward (350M: 2.2 GB a rank, 0.03 s pause, was 5.8 s "
    "while training waited for the write), with the optimizer state on NVMe read from its swap files "
    "(1B: 5.7 GB a rank, 0.02 s, was 18.4 s). The pause is not the whole cost: the write shares the "
    "cores and the disk with the step it runs beside. At 1B here, where the swap files and the "
    "checkpoint share one disk, that step took as long as the old pause plus step (an A/B on the same "
    "machine state: the interval holding the checkpoint 112.9 s beside the step, 112.6 s with training "
    "stopped for 23.4 s); it gains where the checkpoint goes to other storage or the step runs on a GPU. "
    "A miss would mean the write outlasts the next step's "
    "forward and backward: a disk slower than the step, or DeepSpeed's pipelined swapper (its writes may "
    "be in flight after the update, so the file is then streamed while training waits).",
    "commit bandwidth": "commit counts from the checkpoint's step (its state exists) to the committed "
    "manifest. Each rank's write is watched by a call of its own that returns when it ends (looked at "
    "five times a second while the driver waits for a step), so a checkpoint commits when its last file "
    "is in, not with the next step's report (30M: 1.0-1.2 s, was 4.3 s). The disk is shared and its "
    "fsynced write bandwidth varies threefold between runs (372 MB/s to 1.04 GB/s at 30M), so compare "
    "the ratio within one run. A miss means the write itself (copy into the page cache, sha256, fsync) "
    "is slower than the disk; the writer's priority does not matter (nice 0, 10, 19 measured at 30M).",
    "recovery, fixed part": "kill to first completed step, less the checkpoint's bytes at half the disk's "
    "read bandwidth and less the redone step's own compute (the quickest step trained after the restart in "
    "the same run). Where the rest goes (`timeline` and `restart_*` in scale.json): the engine build no "
    "longer gathers every parameter for its gradient hooks nor broadcasts each one at creation, and a "
    "worker probes its CPU once (py-cpuinfo's 1.1 s subprocess, 3-5 times per offloaded build before): at "
    "350M the build fell from 8.1 s to 3.0 s and the set-up from 12.0 s to 6.1 s (fixed part 6.99 s -> "
    "0.56 s); 125M sets up in 2.5 s. At 1B (Adam's state on NVMe) a restoring build no longer writes the "
    "fp32 master into the swap files, nor does the load read it back: the load fills each sub-group in its "
    "swap buffers and writes it once (1.9 GB a rank less written and read): set-up 29.8 s -> 21.8 s (build "
    "13.9 -> 10.7 s, load 16.0 -> 10.7 s); the fixed part then came out negative, an invalid figure: the "
    "load took less than its allowance of half the disk's read bandwidth. At 30M (3 -> 2 ranks) a survivor "
    "could not leave the broken attempt in some runs (16-19 s kill to first step, fixed part 16.2 s): its "
    "training thread waited in a gloo all-gather (DeepSpeed's "
    "parameter fetch) behind a send to the killed peer. gloo's TCP transport never fails a send left "
    "half-written in a connection's queue when the connection closes, so only the collective timeout "
    "would end it and the controller replaced the rank. With 3 or more gloo ranks the gathers now run in "
    "pieces the connections' send buffers take whole (compat/torch_dist/gloo_gather.py: 2 MiB pieces, "
    "buffers "
    "widened to 8 MiB): fixed part 0.48 s (0.40-0.69 s in 4 runs with 4 MiB pieces), none replaced "
    "(3-process kill test: a survivor stuck in 23 of 75 kills with whole gathers, 0 of 25 with 2 MiB "
    "pieces; 4 MiB pieces once left one stuck in 8 kills inside a full test-suite run). Rare, not "
    "impossible: only gloo can fail such a send.",
    "controller iteration": "most of an iteration is building one frozen WorkerObservation per worker in "
    "Python. Closing it: keep the observations in arrays (or update them incrementally) and scan only "
    "the workers whose state changed.",
}


def _why(name: str) -> str:
    return next((text for key, text in WHY.items() if name.startswith(key) or key in name), "")


def _flatten(prefix: str, value: Any, out: list[tuple[str, Any]]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else k, v, out)
    else:
        out.append((prefix, value))


def write_markdown(results: list[dict[str, Any]], out: Path, plots: dict[str, str]) -> None:
    first = results[0]
    m, v = first["machine"], first["versions"]
    smoke = any(r["smoke"] for r in results)
    lines = [
        "# Benchmarks",
        "",
        f"**Every figure here was measured on CPU, with the gloo backend, on {m['cpus']} cores**, unless its "
        "section says otherwise (the GPU check at the end).",
        "",
        "Generated by `make bench` (`python -m benchmarks.run`) from `benchmarks/results/*.json`;",
        "do not edit.",
        "Every figure is a ratio of systems measured side by side in the same run, on the same model, data",
        "and DeepSpeed config (CPU, gloo, one thread per rank): absolute times on shared machines drift.",
        "",
    ]
    if smoke:
        lines += ["**Smoke run**: smallest sizes, not a measurement. Run `make bench` for real figures.", ""]
    lines += [
        f"- Machine: {m['cpus']} CPUs ({m.get('cpu_model') or 'unknown CPU'}), "
        f"{(m.get('memory_bytes') or 0) / 2**30:.0f} GiB, {m['platform']}, Python {m['python']}; "
        f"load average at start {', '.join(f'{x:.1f}' for x in m.get('load_average_at_start', []))}",
        "- Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
        "- Repetitions: "
        + ", ".join(f"{r['benchmark']} {r['repetitions']}" for r in results)
        + "; figures are medians over repetitions (and over steps within a run)",
        f"- Workload: {_workload_line(results)}",
        "",
        "## Targets",
        "",
        "| Benchmark | Figure | Measured | Target | Status |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        for t in r["targets"]:
            lines.append(
                f"| {r['benchmark']} | {t['name']} | {_fmt(t['value'], t['unit'])} | "
                f"{t['direction']} {_fmt(t['target'], t['unit'])} | {_status(t)} |"
            )
    invalid = [(t, v) for r in results for t in r["targets"] if (v := _verdict(t)).invalid]
    if invalid:
        lines += ["", "Invalid measurements (a negative duration or cost), and why:", ""]
        lines += [f"- {t['name']}: {v.invalid}" for t, v in invalid]
    missed = [t for r in results for t in r["targets"] if _verdict(t).met is False]
    if missed:
        lines += ["", "Missed targets, why, and what would close them:", ""]
        lines += [f"- {t['name']} ({_status(t)}): {_why(t['name'])}" for t in missed]
    unmeasured = [t for r in results for t in r["targets"] if _verdict(t).met is None and _why(t["name"])]
    if unmeasured:
        lines += ["", "Not measured, and why:", ""]
        lines += [f"- {t['name']}: {_why(t['name'])}" for t in unmeasured]
    lines.append("")
    for r in results:
        lines += [f"## {r['benchmark']}", ""]
        if r["benchmark"] in plots:
            lines += [f"![{r['benchmark']}]({plots[r['benchmark']]})", ""]
        flat: list[tuple[str, Any]] = []
        _flatten("", r["metrics"], flat)
        lines += ["| Median | Value |", "|---|---|"]
        lines += [f"| {k} | {_fmt(val)} |" for k, val in flat]
        notes = list(r["notes"]) + [t["note"] for t in r["targets"] if t.get("note")]
        if notes:
            lines += [""] + [f"- {n}" for n in notes]
        lines.append("")
    from benchmarks.gpu_check import report as gpu_report

    lines += gpu_report.section(gpu_report.load(gpu_report.ROOT / "benchmarks" / "results"))
    out.write_text("\n".join(lines))


def _workload_line(results: list[dict[str, Any]]) -> str:
    w = next((r["workload"] for r in results if r["workload"].get("hf_config")), None)
    if not w:
        return "n/a"
    hf = w["hf_config"]
    return (
        f"{hf.get('model_type')} with {hf.get('num_hidden_layers')} layers, hidden {hf.get('hidden_size')}, "
        f"vocabulary {hf.get('vocab_size')}, sequence {w['seq_len']}; global batch {w['global_batch_size']} "
        f"(micro batch {w['micro_batch_size']}), ZeRO stage {w['zero_stage']}, {w['precision']}; "
        f"{w['warmup_steps_skipped']} warm-up step(s) skipped, {w['measured_steps']} measured"
    )


def load_results(folder: Path, names: list[str]) -> list[dict[str, Any]]:
    return [json.loads((folder / f"{n}.json").read_text()) for n in names if (folder / f"{n}.json").exists()]
