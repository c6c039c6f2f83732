"""peft's check for ZeRO-3, answered for models built under our own zero.Init."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from elastictrain.compat.registry import has_parameters, patch


def _check() -> str | None:
    from peft.utils import integrations

    return has_parameters(integrations.check_deepspeed_zero3_enabled, where="check_deepspeed_zero3_enabled")


@patch(
    "peft_sees_zero3",
    package="peft",
    tested=">=0.13",
    kind="correctness",
    check=_check,
    gains=(
        "correctness: DoRA's magnitude of a config-built ZeRO-3 model is computed from the gathered base "
        "weights, not empty shards"
    ),
)
@contextlib.contextmanager
def base_weights_gathered_for_peft(model: Any) -> Iterator[None]:
    """Let peft gather a ZeRO-3 layer where it reads its weight.

    What: `peft.utils.integrations.check_deepspeed_zero3_enabled` answers True while the block runs, for
    a model whose parameters are ZeRO-3 partitioned (`ds_id`).
    Why: DoRA's magnitude starts as the norm of each base weight's rows; peft gathers the weight only when
    transformers says ZeRO-3 is on, which only a pretrained model's build sets (model/build.py): a
    config-built or factory model would give peft the empty local tensors of its partitioned weights.
    Retired by: peft detecting a partitioned parameter itself (its `ds_id`) rather than asking
    transformers' global ZeRO-3 flag; no upstream issue found.
    """
    if not any(hasattr(p, "ds_id") for p in model.parameters()):
        yield
        return
    from peft.utils import integrations

    said = integrations.check_deepspeed_zero3_enabled
    integrations.check_deepspeed_zero3_enabled = lambda: True
    try:
        yield
    finally:
        integrations.check_deepspeed_zero3_enabled = said
