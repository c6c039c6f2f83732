"""A step whose gradients are not finite is not applied, at every ZeRO stage and precision.

DeepSpeed skips such a step itself where its optimizer measures the gradients before updating: ZeRO-1
and 2 (the global norm; bf16 and fp16 through their overflow check), ZeRO-3, the bf16 optimizer, and
fp16's loss scaler (which also skips the steps its scale search overflows). Without ZeRO in fp32 the
optimizer is torch's own, which applies whatever it is given: one NaN gradient and every later weight and
loss is NaN, and the run still finishes. There the optimizer's step is guarded here: it first takes the
gradients' global norm and, where that is not finite, does not update and says `overflow`, which the
engine reads after every step as it reads its own optimizers' (it then counts a skipped step). Gradients
are averaged over the ranks before the update, so every rank makes the same decision; pipeline stages
hold different gradients, so there (`across_ranks`) the ranks agree on it with one all-reduce.
"""

from __future__ import annotations

import inspect
from typing import Any

from elastictrain.compat.registry import patch


def _check_engine_reads_overflow() -> str | None:
    from deepspeed.runtime.engine import DeepSpeedEngine

    take = getattr(DeepSpeedEngine, "_take_model_step", None)
    if take is None:
        return "DeepSpeedEngine has no _take_model_step"
    source = inspect.getsource(take)
    if "overflow" not in source or "_step_applied" not in source:
        return "DeepSpeedEngine._take_model_step no longer reads optimizer.overflow into _step_applied"
    return None


@patch(
    "non_finite_steps_skipped_without_zero",
    package="deepspeed",
    kind="correctness",
    check=_check_engine_reads_overflow,
    gains=(
        "correctness: at ZeRO-0 in fp32 a step with a NaN or infinite gradient is skipped, as DeepSpeed's "
        "ZeRO optimizers skip it, instead of turning every later weight and loss into NaN"
    ),
)
def skip_non_finite_updates(engine: Any, *, across_ranks: bool = False) -> None:
    """Guard the step of a plain torch optimizer (no ZeRO, fp32) against non-finite gradients.

    What: the optimizer instance's `step` first takes the gradients' global norm; where it is not finite
    the update is not made and `optimizer.overflow` is True, which `DeepSpeedEngine._take_model_step`
    reads into `_step_applied` and `skipped_steps` as for its own optimizers. DeepSpeed's optimizers
    (ZeRO, bf16, fp16) check for themselves and are left alone.
    Why: without it one NaN gradient at ZeRO-0 in fp32 is applied, every later weight and loss is NaN,
    and the run ends FINISHED; every other stage and precision skips such a step.
    Retired by: DeepSpeed skipping non-finite steps for a client optimizer without ZeRO (its engine
    checking the gradient norm it computes for clipping)."""
    import torch

    optimizer = engine.optimizer
    if type(optimizer).__module__.startswith("deepspeed.") or getattr(optimizer, "_steps_guarded", False):
        return
    update = optimizer.step

    def guarded_step(*args: Any, **kwargs: Any) -> Any:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        # One norm over every gradient (NaN or inf anywhere makes it so); torch >= 2.4 has no get_total_norm.
        norms = torch.stack([torch.linalg.vector_norm(g.detach().float()) for g in grads]) if grads else None
        finite = norms is None or bool(torch.isfinite(torch.linalg.vector_norm(norms)))
        if across_ranks:
            import torch.distributed as dist

            device = "cuda" if dist.get_backend() == "nccl" else "cpu"
            flag = torch.tensor([1.0 if finite else 0.0], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            finite = bool(flag.item() > 0)
        optimizer.overflow = not finite
        return update(*args, **kwargs) if finite else None

    optimizer.step = guarded_step
    optimizer.overflow = False
    optimizer._steps_guarded = True


def update_applied(engine: Any) -> bool:
    """Whether the engine's last optimizer step changed the weights (False: skipped, its gradients not
    finite or fp16's loss scale overflowing)."""
    return bool(getattr(engine, "_step_applied", True))
