"""Losses of the global batch, from what each rank reports of its share.

With the built-in causal LM loss each rank reports its summed token losses and its target tokens, so a
step's loss (and a validation loss) is one mean over every target token of the global batch: the same
at any world size and micro-batch split.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any


def step_loss(results: Sequence[Mapping[str, Any]]) -> float:
    """A step's loss: per target token of the global batch when ranks count them, else the ranks' mean."""
    if results and all(r.get("target_tokens") is not None for r in results):
        tokens = sum(int(r["target_tokens"]) for r in results)
        return sum(float(r["loss_sum"]) for r in results) / max(tokens, 1)
    return sum(float(r["loss"]) for r in results) / len(results)


def perplexity(loss: float) -> float:
    """exp(loss), inf where it overflows."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf
