"""Part g: pipeline stages against ZeRO-3 at two ranks, where the machine has two devices.

The numerics part's small model trained twice at two ranks, one after the other: ZeRO-3 (data parallel
2), then two pipeline stages x data parallel 1 under ZeRO-1 (`scaling.pipeline_parallel=2`: the decoder's
layers split between the ranks, DeepSpeed's 1F1B schedule). A step's time is the wall time between two
completed steps as the controller sees them; the first `warmup_steps` are skipped. Both losses are
recorded: the two layouts train the same model on the same batches.

A stage needs a device of its own (NCCL runs one rank per GPU): on a machine with one GPU the part
records why it measured nothing. The dry profile runs it on two CPU workers.
"""

from __future__ import annotations

from typing import Any

from benchmarks.gpu_check import runs
from benchmarks.gpu_check.profile import TINY

LAYOUTS = {
    "zero3_dp2": ("deepspeed.zero_stage=3",),
    "pp2_zero1": ("deepspeed.zero_stage=1", "scaling.pipeline_parallel=2"),
}


def run(ctx: Any) -> None:
    p = ctx.profile
    if p.use_gpu:
        import torch

        gpus = torch.cuda.device_count()
        ctx.record("gpus", gpus)
        if gpus < 2:
            ctx.record(
                "not_measured",
                f"two pipeline stages need two GPUs on one node (a rank per GPU); this machine has {gpus}",
            )
            return
    n = p.warmup_steps + p.measured_steps
    common = (*p.small_model, f"training.max_steps={n}", f"checkpoint.every_steps={n}")
    step_s: dict[str, float | None] = {}
    for name, extra in LAYOUTS.items():
        cfg = runs.config(p, TINY, ctx.work / name, *common, *extra, workers=2)
        record = runs.train(cfg)
        intervals = runs.measured_intervals(record["steps"], p.warmup_steps + 1, n)
        step_s[name] = runs.median(intervals)
        losses = [s["loss"] for s in record["steps"]]
        ctx.record(name, {"step_s": intervals, "median_step_s": step_s[name], "losses": losses})
    zero3, pp = step_s["zero3_dp2"], step_s["pp2_zero1"]
    ctx.record("pp2_vs_zero3_step_time", pp / zero3 if pp and zero3 else None)
