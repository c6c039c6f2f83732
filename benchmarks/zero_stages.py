"""Throughput and checkpoint cost of each ZeRO stage at the same size, so users can choose a stage.

elastictrain runs the workload at world size 2 under ZeRO stages 0, 1, 2 and 3 (same model, data,
batch and steps; the stage-3 run is the one the throughput benchmark also reads), measuring samples/s
as the controller sees steps complete, the time from queuing the final checkpoint to its commit, and
the workers' peak memory. No target: which stage wins depends on model size and interconnect;
on a model that fits one rank, stages 0-2 skip ZeRO-3's parameter gathers in every forward and backward.

It also runs tensor parallelism at the same two ranks (TP 2 x DP 1 under ZeRO-1: each layer split
between the ranks, `scaling.tensor_parallel=2`). On CPU with gloo that only shows what the extra
collectives cost (an all-reduce per sliced layer, forward and backward); what TP buys, layers larger
than one device, shows on GPUs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import baselines
from benchmarks.common import Result, Workload, median, ratio, workload_info
from benchmarks.throughput import samples_per_s

STAGES = (0, 1, 2, 3)
WORLD_SIZE = 2


TP_KEY = "tp2_stage1"  # tensor parallel 2 x data parallel 1, ZeRO-1
TP_OVERRIDES = ("deepspeed.zero_stage=1", "scaling.tensor_parallel=2")


def _stage_run(stage: int | str, w: Workload, tmp: Path, rep: int) -> dict[str, Any]:
    if stage == TP_KEY:
        return baselines.elastictrain(WORLD_SIZE, w, tmp, rep, *TP_OVERRIDES)
    extra = () if stage == 3 else (f"deepspeed.zero_stage={stage}",)  # stage 3 is the default config
    return baselines.elastictrain(WORLD_SIZE, w, tmp, rep, *extra)


def run(w: Workload, tmp: Path, reps: int, smoke: bool) -> Result:
    info = workload_info(w)
    gbs = info["global_batch_size"]
    stages: tuple[int | str, ...] = (2, 3, TP_KEY) if smoke else (*STAGES, TP_KEY)
    runs: list[dict[str, Any]] = []
    for rep in range(reps):
        for stage in stages:
            r = _stage_run(stage, w, tmp, rep)
            commits = [c.get("seconds") for c in r["checkpoints"]]
            runs.append(
                {
                    "rep": rep,
                    "stage": stage,
                    "samples_per_s": samples_per_s(r["steps"], w, gbs),
                    "checkpoint_commit_s": median([c for c in commits if c is not None] or [float("nan")]),
                    "peak_rss_bytes": max((m["peak_rss_bytes"] for m in r["memory"]), default=None),
                }
            )
            sps = runs[-1]["samples_per_s"]
            print(f"  zero_stages rep {rep} stage {stage}: {sps:.2f} samples/s", flush=True)

    per_stage = {
        s if s == TP_KEY else f"stage{s}": {
            key: median([r[key] for r in runs if r["stage"] == s and r[key] is not None] or [float("nan")])
            for key in ("samples_per_s", "checkpoint_commit_s", "peak_rss_bytes")
        }
        for s in stages
    }
    metrics: dict[str, Any] = {"world_size": WORLD_SIZE, **per_stage}
    metrics["stage2_vs_stage3_samples_per_s"] = ratio(
        per_stage["stage2"]["samples_per_s"], per_stage["stage3"]["samples_per_s"]
    )
    metrics["tp2_vs_stage3_samples_per_s"] = ratio(
        per_stage[TP_KEY]["samples_per_s"], per_stage["stage3"]["samples_per_s"]
    )
    notes = [
        f"world size {WORLD_SIZE}, fp32 on CPU with gloo; samples/s as in the throughput benchmark.",
        f"{TP_KEY}: tensor parallel 2 x data parallel 1 under ZeRO-1 ({' '.join(TP_OVERRIDES)}); on CPU "
        "only the cost of its collectives shows.",
        "checkpoint_commit_s: end-of-run checkpoint, from its step to committed (the `checkpoint` event).",
        "peak_rss_bytes: the largest worker's peak resident memory.",
    ]
    return Result("zero_stages", smoke, reps, metrics, [], runs, notes, info)


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(k for k in result["metrics"] if k.startswith("stage") and k[5:].isdigit())
    keys += [k for k in (TP_KEY,) if k in result["metrics"]]
    vals = [result["metrics"][k]["samples_per_s"] or 0 for k in keys]
    labels = ["TP 2, ZeRO-1" if k == TP_KEY else k.replace("stage", "ZeRO-") for k in keys]
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    ax.bar(labels, vals, color="#4c72b0")
    ax.set_ylabel("samples/s (median)")
    ax.set_title(f"Throughput by ZeRO stage, world size {result['metrics']['world_size']}")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
