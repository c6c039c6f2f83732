"""The log-probability a causal LM gives each row's answer tokens: what every preference objective
(model/preference_loss.py) is computed from.

A row's answer tokens are those whose label is not -100 (labels unshifted, as transformers takes them:
the token at t is predicted from the logits at t - 1). Both answers of a pair go through one forward as
two rows of the same micro-batch (TRL's concatenated forward), so a pair's two log-probabilities come
from the same weights and the same padding.

For a LoRA run the reference is the same model with its adapters switched off (peft's disable_adapter):
no second copy of the weights (model/objective.py uses it at every step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

IGNORE = -100


def answer_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probabilities [B], answer token counts [B]) of the labelled tokens of each row.

    Computed in float32 whatever the logits' dtype: a sum over hundreds of tokens in bf16 would lose the
    differences DPO's margin is made of.
    """
    shifted = labels[:, 1:]
    mask = shifted != IGNORE
    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = torch.gather(logprobs, 2, shifted.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * mask).sum(-1), mask.sum(-1)


def pair_logps(
    model: Any, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen logps, rejected logps, chosen tokens, rejected tokens) of a micro-batch whose first half
    of rows are the pairs' chosen answers and second half their rejected ones, in the same order."""
    rows = input_ids.shape[0]
    if rows % 2:
        raise ValueError(
            f"a micro-batch of pairs holds an even number of rows (chosen, then rejected); got {rows}"
        )
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    logps, tokens = answer_logps(logits, labels)
    half = rows // 2
    return logps[:half], logps[half:], tokens[:half], tokens[half:]


@contextlib.contextmanager
def as_reference(model: Any) -> Iterator[Any]:
    """The LoRA model with its adapters off (the frozen base: a LoRA run's reference), without grads."""
    switch = getattr(model, "disable_adapter", None)
    if switch is None:
        raise ValueError(
            "the reference of a run without LoRA is not its own model with adapters off; it needs "
            "reference log-probabilities computed before training"
        )
    with switch(), torch.no_grad():
        yield model
