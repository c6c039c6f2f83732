"""Losses of the global batch, from what each rank reports of its share.

With the built-in causal LM loss each rank reports its summed token losses and its target tokens, so a
step's loss (and a validation loss) is one mean over every target token of the global batch: the same
at any world size and micro-batch split.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def replica_results(results: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """One result per data-parallel replica (its first rank's): the ranks of a tensor-parallel or
    pipeline replica read the same samples and report the same loss, which must count once. Each result
    says its attempt's ranks per replica (`replica_ranks`, 1 where absent)."""
    return [r for r in results if int(r["rank"]) % int(r.get("replica_ranks") or 1) == 0]


def step_loss(results: Sequence[Mapping[str, Any]]) -> float:
    """A step's loss: per target token of the global batch when ranks count them (per item under a
    preference objective), else the ranks' mean."""
    if results and all(r.get("items") is not None for r in results):
        return sum(float(r["loss_sum"]) for r in results) / max(sum(int(r["items"]) for r in results), 1)
    if results and all(r.get("target_tokens") is not None for r in results):
        tokens = sum(int(r["target_tokens"]) for r in results)
        return sum(float(r["loss_sum"]) for r in results) / max(tokens, 1)
    return sum(float(r["loss"]) for r in results) / len(results)


def add_figures(shares: Iterable[Mapping[str, Sequence[float]]]) -> dict[str, list[float]]:
    """Each figure's [sum, count] added up over `shares` ({figure: [sum, count]} each)."""
    totals: dict[str, list[float]] = {}
    for share in shares:
        for name, (s, n) in share.items():
            acc = totals.setdefault(name, [0.0, 0.0])
            acc[0] += float(s)
            acc[1] += float(n)
    return totals


def preference_figures(results: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """rewards/chosen, rewards/margins, logps/rejected, ... over the global batch: every rank's
    [sum, count] of each figure added up (a figure no item counted, e.g. KTO's rewards/rejected in a
    batch of desirable answers only, is left out)."""
    totals = add_figures(r.get("preference") or {} for r in results)
    return {name: s / n for name, (s, n) in sorted(totals.items()) if n > 0}


def perplexity(loss: float) -> float:
    """exp(loss), inf where it overflows."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def eval_summary(results: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """A validation's loss, perplexity and size from every rank's share.

    With the built-in loss: summed token losses over target tokens, exact at any world size. With a
    loss of your own: each micro-batch's mean weighed by its samples.
    """
    samples = sum(int(r["samples"]) for r in results)
    if results and all(r.get("items") is not None for r in results):  # a preference objective
        items = sum(int(r["items"]) for r in results)
        loss = sum(float(r["loss_sum"]) for r in results) / max(items, 1)
        figures = {f"eval_{k}": v for k, v in preference_figures(results).items()}
        return {"eval_loss": loss, "eval_samples": float(samples), **figures}
    if results and all(r.get("target_tokens") is not None for r in results):
        tokens = sum(int(r["target_tokens"]) for r in results)
        loss = sum(float(r["loss_sum"]) for r in results) / max(tokens, 1)
    else:
        tokens = 0
        loss = sum(float(r["loss_sum"]) for r in results) / max(samples, 1)
    return {
        "eval_loss": loss,
        "eval_perplexity": perplexity(loss),
        "eval_tokens": float(tokens),
        "eval_samples": float(samples),
    }


def eval_due(step_done: int, every: int, max_steps: int) -> bool:
    """Whether a validation follows the step that brings the run to `step_done` steps (1-based)."""
    return step_done == max_steps or (every > 0 and step_done % every == 0)
