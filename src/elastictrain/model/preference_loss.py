"""Preference objectives on answers' log-probabilities: DPO (sigmoid, hinge, IPO), SimPO, ORPO and KTO.

The published formulas, as TRL implements them (DPOTrainer.dpo_loss, CPOTrainer's simpo, ORPOTrainer's
odds ratio, KTOTrainer.kto_loss). Inputs are per-pair (or per-record, KTO) tensors of shape [B]:
- `*_logps`: the log-probability of an answer's tokens under the policy (or the reference), summed over
  the answer's tokens;
- `*_tokens`: how many answer tokens each has, for the objectives that use the mean (IPO, SimPO, ORPO).
Every function returns the per-example losses (shape [B]) so that the step can take the mean over the
global batch's pairs, whatever the micro-batch split; and the rewards logged beside them.

This is the loss only; pairs come from data/preference/, the reference's log-probabilities from
model/objective.py (adapters off, or the precomputed table).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

DPO_LOSSES = ("sigmoid", "hinge", "ipo")


@dataclass(frozen=True)
class PreferenceLosses:
    losses: torch.Tensor  # [B], to be averaged over the global batch
    chosen_rewards: torch.Tensor  # [B], detached: beta x the chosen answer's log-ratio (what TRL logs)
    rejected_rewards: torch.Tensor  # [B], detached


def dpo(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    loss: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_tokens: torch.Tensor | None = None,
    rejected_tokens: torch.Tensor | None = None,
) -> PreferenceLosses:
    """DPO against a reference. sigmoid: -log sigmoid(beta m) (conservative DPO with label_smoothing);
    hinge: relu(1 - beta m); ipo: (m - 1/(2 beta))^2 on mean log-probabilities (IPO's paper, as TRL),
    where m is the policy's margin minus the reference's."""
    if loss not in DPO_LOSSES:
        raise ValueError(f"loss: got {loss!r}; expected one of {', '.join(DPO_LOSSES)}")
    if loss == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("ipo averages over the answers' tokens: give chosen_tokens and rejected_tokens")
        chosen_logps, ref_chosen_logps = chosen_logps / chosen_tokens, ref_chosen_logps / chosen_tokens
        rejected_logps, ref_rejected_logps = (
            rejected_logps / rejected_tokens,
            ref_rejected_logps / rejected_tokens,
        )
    chosen_ratio = chosen_logps - ref_chosen_logps
    rejected_ratio = rejected_logps - ref_rejected_logps
    margin = chosen_ratio - rejected_ratio
    if loss == "sigmoid":
        losses = (
            -F.logsigmoid(beta * margin) * (1 - label_smoothing)
            - F.logsigmoid(-beta * margin) * label_smoothing
        )
    elif loss == "hinge":
        losses = torch.relu(1 - beta * margin)
    else:
        losses = (margin - 1 / (2 * beta)) ** 2
    return PreferenceLosses(losses, (beta * chosen_ratio).detach(), (beta * rejected_ratio).detach())


def simpo(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    *,
    beta: float = 2.0,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
) -> PreferenceLosses:
    """SimPO: -log sigmoid(beta (mean chosen - mean rejected) - gamma), reference-free (its paper's
    length-normalised reward and target margin gamma, as TRL's CPOTrainer computes it)."""
    chosen, rejected = chosen_logps / chosen_tokens, rejected_logps / rejected_tokens
    logits = (chosen - rejected) - gamma / beta
    losses = (
        -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    )
    return PreferenceLosses(losses, (beta * chosen).detach(), (beta * rejected).detach())


def orpo(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    *,
    beta: float = 0.1,
) -> PreferenceLosses:
    """ORPO: the chosen answer's mean NLL minus beta log sigmoid(log odds ratio), the odds of each
    answer from its mean token log-probability (its paper's eq. 4-7). The NLL is each pair's own mean
    over its answer's tokens, as the paper writes it; TRL's ORPOTrainer takes one mean over all the
    batch's chosen tokens, which would weight pairs by length and change with the micro-batch split."""
    chosen, rejected = chosen_logps / chosen_tokens, rejected_logps / rejected_tokens
    log_odds = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
    losses = -chosen - beta * F.logsigmoid(log_odds)
    return PreferenceLosses(losses, (beta * chosen).detach(), (beta * rejected).detach())


def kto(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> PreferenceLosses:
    """KTO on unpaired records: 1 - sigmoid(beta (r - z)) for a desirable answer, 1 - sigmoid(beta (z - r))
    for an undesirable one, r its log-ratio to the reference, z the batch's KL estimate (`kl`: the mean
    log-ratio of mismatched prompt-answer pairs, clamped at 0 and detached, as TRL's kto_loss)."""
    ratio = logps - ref_logps
    z = kl.clamp(min=0).detach()
    good = desirable.bool()
    losses = torch.where(
        good,
        desirable_weight * (1 - torch.sigmoid(beta * (ratio - z))),
        undesirable_weight * (1 - torch.sigmoid(beta * (z - ratio))),
    )
    rewards = (beta * ratio).detach()
    return PreferenceLosses(losses, torch.where(good, rewards, 0.0), torch.where(good, 0.0, rewards))
