"""Part f: tensor parallelism against ZeRO-3 at two ranks, where the machine has two devices.

The numerics part's small model trained twice at two ranks, one after the other: ZeRO-3 (data parallel
2), then tensor parallel 2 x data parallel 1 under ZeRO-1 (`scaling.tensor_parallel=2`: every attention
and MLP projection split between the two ranks, AutoTP). A step's time is the wall time between two
completed steps as the controller sees them; the first `warmup_steps` are skipped. Both losses are
recorded: the two layouts train the same model on the same batches.

A replica's ranks need a device each (NCCL runs one rank per GPU): on a machine with one GPU the part
records why it measured nothing. The dry profile runs it on two CPU workers, where only the cost of the
extra all-reduces shows.
"""

from __future__ import annotations

from typing import Any

from benchmarks.gpu_check import runs
from benchmarks.gpu_check.profile import TINY

LAYOUTS = {
    "zero3_dp2": ("deepspeed.zero_stage=3",),
    "tp2_zero1": ("deepspeed.zero_stage=1", "scaling.tensor_parallel=2"),
}


def run(ctx: Any) -> None:
    against_zero3(ctx, "tp2_zero1", LAYOUTS["tp2_zero1"], "tensor parallel 2")


def against_zero3(ctx: Any, name: str, layout: tuple[str, ...], what: str) -> None:
    """Train the small model at two ranks under ZeRO-3, then under `layout` (recorded as `name`), and
    record both runs' step times and losses and `<name minus its _zero1>_vs_zero3_step_time`; on a
    machine with fewer than two GPUs, `not_measured` and why (`what` needs a rank per GPU)."""
    p = ctx.profile
    if p.use_gpu:
        import torch

        gpus = torch.cuda.device_count()
        ctx.record("gpus", gpus)
        if gpus < 2:
            ctx.record(
                "not_measured", f"{what} needs two GPUs on one node (a rank per GPU); this machine has {gpus}"
            )
            return
    n = p.warmup_steps + p.measured_steps
    common = (*p.small_model, f"training.max_steps={n}", f"checkpoint.every_steps={n}")
    step_s: dict[str, float | None] = {}
    for run_name, extra in {"zero3_dp2": LAYOUTS["zero3_dp2"], name: layout}.items():
        cfg = runs.config(p, TINY, ctx.work / run_name, *common, *extra, workers=2)
        record = runs.train(cfg)
        intervals = runs.measured_intervals(record["steps"], p.warmup_steps + 1, n)
        step_s[run_name] = runs.median(intervals)
        losses = [s["loss"] for s in record["steps"]]
        ctx.record(run_name, {"step_s": intervals, "median_step_s": step_s[run_name], "losses": losses})
    zero3, other = step_s["zero3_dp2"], step_s[name]
    ctx.record(
        f"{name.removesuffix('_zero1')}_vs_zero3_step_time", other / zero3 if other and zero3 else None
    )
