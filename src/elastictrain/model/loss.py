"""The built-in causal LM loss, normalised by the target tokens of the whole global batch.

A micro-batch's mean loss weighs its tokens by 1/(tokens in that micro-batch): with padding or masked
labels, the gradient then depends on how the global batch is cut into micro-batches and ranks. Here each
micro-batch contributes the *sum* of its token losses, scaled by 1/(target tokens of the global batch),
counted once per step before the first forward (one all-reduce of one integer). DeepSpeed divides each
backward by the accumulation steps and averages gradients over ranks, so the scale is multiplied back by
both: the step's gradient is then sum(token losses) / global target tokens at any world size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

IGNORE_INDEX = -100  # labels that carry no loss (padding, prompts), as in transformers


def lm_labels(batch: Any) -> torch.Tensor:
    """The labels the default loss trains on: `labels`, else `input_ids` (a tensor batch is token ids)."""
    labels = batch.get("labels", batch.get("input_ids")) if isinstance(batch, Mapping) else batch
    if not isinstance(labels, torch.Tensor):
        raise TypeError(
            "training.loss: not set, and the batch has neither `labels` nor `input_ids` tensors; give a "
            "dict batch with input_ids (and labels, -100 where no loss is wanted) or set training.loss"
        )
    return labels


def target_tokens(batch: Any) -> int:
    """Tokens with a loss in a batch: labels shifted by one (the next token), minus ignored ones."""
    return int(target_token_count(batch))


def target_token_count(batch: Any) -> torch.Tensor:
    """target_tokens as a 0-dim tensor on the batch's device: counted without waiting for the device."""
    return (lm_labels(batch)[..., 1:] != IGNORE_INDEX).sum()


def causal_lm_token_loss_sum(model: Any, batch: Any) -> torch.Tensor:
    """The sum of next-token cross entropies of one micro-batch (a 0-dim fp32 tensor, not synchronised).

    The same loss as transformers' causal LM loss (logits in fp32, labels shifted, -100 ignored), with
    the mean left to the caller so it can divide by the global batch's count.
    """
    labels = lm_labels(batch)
    if isinstance(batch, Mapping):
        kwargs = {k: v for k, v in batch.items() if k != "labels"}
    else:
        kwargs = {"input_ids": batch}
    out = model(**kwargs)
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, Mapping):
        logits = out.get("logits")
    if not isinstance(logits, torch.Tensor):
        raise TypeError(
            "training.loss: not set, and the model's output has no `logits`; give training.loss as "
            "'module:attr', a function loss(model, batch) -> scalar tensor"
        )
    return token_loss_sum(logits, labels)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed next-token cross entropy of `logits` against `labels` (shifted by one, -100 ignored)."""
    shifted = labels[..., 1:].reshape(-1).to(logits.device)
    flat = logits[..., :-1, :].reshape(-1, logits.shape[-1]).float()
    return torch.nn.functional.cross_entropy(flat, shifted, ignore_index=IGNORE_INDEX, reduction="sum")


def causal_lm_loss_sum(model: Any, batch: Any) -> tuple[torch.Tensor, int]:
    """(sum of next-token cross entropies, number of target tokens) of one micro-batch."""
    return causal_lm_token_loss_sum(model, batch), target_tokens(batch)


def global_count(local: torch.Tensor) -> torch.Tensor:
    """The sum of the 0-dim tensor `local` (a count, or a preference objective's float64 sum) over every
    rank of the process group (itself without one), left on its device: the all-reduce is queued, nobody
    waits for it here."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local
    total = local.detach().clone().reshape(1)
    dist.all_reduce(total)
    return total[0]
