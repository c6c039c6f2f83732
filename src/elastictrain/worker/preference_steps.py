"""One step's (or one validation batch's) micro-batches under a preference objective on one rank.

The step's loss is the mean of the per-item losses over the global batch's items: each micro-batch
backs up the *sum* of its items' losses times world_size x accumulation / (items of the global batch),
undoing DeepSpeed's division by both, as the causal LM loss does with target tokens (model/loss.py).

KTO's KL estimate is the policy's mean log-ratio over the global batch's mismatched rows: a forward
without gradients of every micro-batch's second rows and one all-reduce come first, so every rank at any
world size uses the same estimate (TRL's is gathered over processes as well, per batch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from elastictrain.model.loss import global_count
from elastictrain.model.objective import PreferenceObjective


def _global_sum(value: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    total = value.detach().clone().reshape(1)
    dist.all_reduce(total)
    return total[0]


def kto_estimate(
    engine: Any, objective: PreferenceObjective, batches: Sequence[Any], items: torch.Tensor
) -> Any:
    """KTO's KL estimate over the global batch (`items`: its item count), the same on every rank."""
    local = torch.zeros((), dtype=torch.float64, device=engine.device)
    for batch in batches:
        local = local + objective.kl_sum(engine, batch)
    # Every rank of a tensor-parallel replica adds the same sums, as `items` counts them: the ratio holds.
    return _global_sum(local) / items.clamp(min=1).double()


def run_preference_batches(
    engine: Any,
    objective: PreferenceObjective,
    batches: Sequence[tuple[Any, int]],
    *,
    world_size: int,
    train: bool,
    on_micro: Callable[[], None] = lambda: None,
    before_update: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Forward (and, with `train`, backward and DeepSpeed's step) each (batch, seed); this rank's sums.

    Returns loss_sum, items and `preference`: {figure: [sum, count]} over this rank's items."""
    counts = [torch.tensor(b["input_ids"].shape[0] // 2, device=engine.device) for b, _ in batches]
    local = torch.stack(counts).sum()
    total = global_count(local)
    kl = None
    if objective.name == "kto":
        kl = kto_estimate(engine, objective, [b for b, _ in batches], total)
    scale = ((world_size * len(batches)) / total.clamp(min=1).double()).float()
    loss_sum = torch.zeros((), dtype=torch.float64, device=engine.device)
    sums: dict[str, list[torch.Tensor]] = {}
    last = len(batches) - 1
    for i, (batch, seed) in enumerate(batches):
        torch.manual_seed(seed)  # any randomness follows the data position, not the rank
        if train:
            terms = objective.terms(engine, batch, kl)
            summed = terms.losses.sum()
            engine.backward(summed * scale.to(summed.device))
            if i == last:
                before_update()
            engine.step()
            on_micro()
        else:
            with torch.no_grad():
                terms = objective.terms(engine, batch, kl)
                summed = terms.losses.sum()
        loss_sum = loss_sum + summed.detach().double()
        for name, (s, n) in terms.stats.items():
            acc = sums.setdefault(name, [torch.zeros((), dtype=torch.float64, device=engine.device)] * 2)
            sums[name] = [acc[0] + s.double(), acc[1] + n.double()]
    names = sorted(sums)
    flat = torch.stack([loss_sum, local.double()] + [x for k in names for x in sums[k]]).tolist()
    figures = {k: [flat[2 + 2 * j], flat[3 + 2 * j]] for j, k in enumerate(names)}
    return {"loss_sum": flat[0], "items": int(flat[1]), "preference": figures}
