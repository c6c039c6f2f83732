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

from benchmarks.gpu_check.tensor_parallel import against_zero3


def run(ctx: Any) -> None:
    against_zero3(
        ctx, "pp2_zero1", ("deepspeed.zero_stage=1", "scaling.pipeline_parallel=2"), "pipeline parallel 2"
    )
