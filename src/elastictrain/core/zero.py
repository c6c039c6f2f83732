"""What each ZeRO stage can do: offload targets and precisions, as DeepSpeed and elastic checkpoints allow.

Stage 0 is plain data parallelism (every rank holds everything); stages 1 and 2 partition the
optimizer state (and, in 2, the gradients) and may offload it to CPU; stage 3 also partitions the
parameters and may offload both to CPU or NVMe (DeepSpeed's ZeRO-Infinity swaps to NVMe only in
stage 3). fp16 and bf16 without ZeRO run DeepSpeed's FP16 optimizers (DeepSpeed 0.19 wraps bf16 at
stage 0 in FP16_UnfusedOptimizer too), whose state layout elastic checkpoints do not read.
"""

from __future__ import annotations

ZERO_STAGES = (0, 1, 2, 3)


def stage_problems(stage: object, offload_optimizer: str, offload_param: str, precision: str) -> list[str]:
    """What DeepSpeed (or an elastic checkpoint) cannot do at this ZeRO stage."""
    if stage not in ZERO_STAGES:
        return []  # the stage's own check names it
    p = []
    if offload_param != "none" and stage != 3:
        p.append(
            f"deepspeed.offload_param: got {offload_param!r} with deepspeed.zero_stage {stage}; "
            "offloading parameters needs ZeRO stage 3 (set offload_param=none or zero_stage=3)"
        )
    if offload_optimizer == "nvme" and stage != 3:
        p.append(
            f"deepspeed.offload_optimizer: got 'nvme' with deepspeed.zero_stage {stage}; DeepSpeed swaps "
            "optimizer state to NVMe only in ZeRO stage 3 (stages 1 and 2 offload to 'cpu')"
        )
    if offload_optimizer == "cpu" and stage == 0:
        p.append(
            "deepspeed.offload_optimizer: got 'cpu' with deepspeed.zero_stage 0; "
            "optimizer offload needs ZeRO stage 1, 2 or 3"
        )
    if precision in ("fp16", "bf16") and stage == 0:
        p.append(
            f"training.precision: got {precision!r} with deepspeed.zero_stage 0; elastic checkpoints of "
            f"{precision} need ZeRO stage 1-3 (ZeRO-1 computes what plain data parallelism does), or fp32 at "
            "stage 0"
        )
    return p
