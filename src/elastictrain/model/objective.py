"""A preference objective inside the step: the policy's and the reference's log-probabilities of a
micro-batch's rows (data/preference/dataset.py), the per-item losses (model/preference_loss.py) and the
figures TRL logs beside them.

Rows: a micro-batch of B items holds 2B rows, every item's first row (a pair's chosen answer, a KTO
record's answer) then every second row (the rejected answer, the KTO record's mismatched answer). The
reference is, by `reference`: `adapters` (the same model with its LoRA adapters off, one more forward
without gradients), `precomputed` (the batch's `reference` column, read from the run folder) or `none`
(ORPO and SimPO need none).

Every figure is reported as (sum, count) over the rank's items, so the controller's means are over the
global batch whatever the split (core/preference_metrics.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from elastictrain.core.objectives import reference_kind
from elastictrain.model import preference_loss as pl
from elastictrain.model.answer_logps import answer_logps, as_reference


def disable_dropout(model: torch.nn.Module) -> int:
    """Dropout off in every module (LoRA's too), as TRL's preference trainers do by default: the policy's
    and the reference's log-probabilities then differ only by the weights (DPO is ln 2 before the first
    update). Returns how many dropout modules were found."""
    found = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
            found += 1
    return found


@dataclass
class Terms:
    """One micro-batch's per-item losses (with gradients) and its figures as (sum, count) tensors."""

    losses: torch.Tensor
    stats: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


@dataclass(frozen=True)
class PreferenceObjective:
    name: str
    reference: str  # adapters | precomputed | none
    dpo_loss: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    ftx: float = 0.0
    simpo_gamma: float = 0.5
    kto_desirable_weight: float = 1.0
    kto_undesirable_weight: float = 1.0

    @classmethod
    def from_config(cls, config: Any) -> PreferenceObjective | None:
        name = getattr(config.training, "objective", "lm")
        if name == "lm":
            return None
        p = config.preference
        return cls(
            name=name,
            reference=reference_kind(name, p.reference, bool(config.model.lora.enabled)),
            dpo_loss=p.dpo_loss,
            beta=float(p.beta),
            label_smoothing=float(p.label_smoothing),
            ftx=float(p.ftx),
            simpo_gamma=float(p.simpo_gamma),
            kto_desirable_weight=float(p.kto_desirable_weight),
            kto_undesirable_weight=float(p.kto_undesirable_weight),
        )

    # -- log-probabilities
    def policy_logps(
        self, model: Any, batch: dict[str, Any], rows: slice
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed answer log-probabilities, answer tokens) of `rows`, with gradients where enabled."""
        out = model(input_ids=batch["input_ids"][rows], attention_mask=batch["attention_mask"][rows])
        return answer_logps(out.logits, batch["labels"][rows])

    def reference_logps(self, model: Any, batch: dict[str, Any], rows: slice) -> torch.Tensor:
        """The reference's summed answer log-probabilities of `rows` (no gradients)."""
        if self.reference == "precomputed":
            if "reference" not in batch:
                raise RuntimeError(
                    "preference.reference is precomputed but this batch carries no reference "
                    "log-probabilities: the reference pass has not reached the workers"
                )
            ref = batch["reference"].to(batch["input_ids"].device)  # [B, 2]: first row, second row
            return torch.cat([ref[:, 0], ref[:, 1]])[rows]
        module = getattr(model, "module", model)
        with as_reference(module):
            logps, _ = self.policy_logps(model, batch, rows)
        return logps.detach()

    # -- KTO's KL estimate: the policy's mean log-ratio on mismatched rows, over the global batch
    def kl_sum(self, model: Any, batch: dict[str, Any]) -> torch.Tensor:
        """Sum over the micro-batch's items of their mismatched row's log-ratio (no gradients)."""
        half = batch["input_ids"].shape[0] // 2
        second = slice(half, 2 * half)
        with torch.no_grad():
            logps, _ = self.policy_logps(model, batch, second)
            ref = self.reference_logps(model, batch, second)
        return (logps - ref).double().sum()

    # -- losses
    def terms(self, model: Any, batch: dict[str, Any], kl: torch.Tensor | None = None) -> Terms:
        if self.name == "kto":
            assert kl is not None, "kto: the global batch's KL estimate comes first"
            return self._kto_terms(model, batch, kl)
        half = batch["input_ids"].shape[0] // 2
        everything = slice(0, 2 * half)
        ref = self.reference_logps(model, batch, everything) if self.reference != "none" else None
        logps, tokens = self.policy_logps(model, batch, everything)
        chosen, rejected = logps[:half], logps[half:]
        c_tok, r_tok = tokens[:half].float(), tokens[half:].float()
        if self.name == "dpo":
            assert ref is not None
            out = pl.dpo(
                chosen,
                rejected,
                ref[:half],
                ref[half:],
                beta=self.beta,
                loss=self.dpo_loss,
                label_smoothing=self.label_smoothing,
                chosen_tokens=c_tok,
                rejected_tokens=r_tok,
            )
        elif self.name == "simpo":
            out = pl.simpo(
                chosen,
                rejected,
                c_tok,
                r_tok,
                beta=self.beta,
                gamma=self.simpo_gamma,
                label_smoothing=self.label_smoothing,
            )
        else:
            out = pl.orpo(chosen, rejected, c_tok, r_tok, beta=self.beta)
        losses = out.losses
        if self.ftx > 0:  # LLaMA-Factory's pref_ftx: the chosen answer's mean token NLL, per pair
            losses = losses + self.ftx * (-chosen / c_tok)
        n = torch.full((), half, dtype=torch.float64, device=losses.device)
        margins = out.chosen_rewards - out.rejected_rewards
        stats = {
            "rewards/chosen": out.chosen_rewards,
            "rewards/rejected": out.rejected_rewards,
            "rewards/margins": margins,
            "rewards/accuracies": (margins > 0).float(),
            "logps/chosen": chosen.detach(),
            "logps/rejected": rejected.detach(),
        }
        return Terms(losses, {k: (v.double().sum(), n) for k, v in stats.items()})

    def _kto_terms(self, model: Any, batch: dict[str, Any], kl: torch.Tensor) -> Terms:
        half = batch["input_ids"].shape[0] // 2
        first = slice(0, half)
        ref = self.reference_logps(model, batch, first) if self.reference != "none" else None
        assert ref is not None
        logps, tokens = self.policy_logps(model, batch, first)
        good = batch["desirable"].to(logps.device).bool()
        out = pl.kto(
            logps,
            ref,
            good,
            kl.to(logps.device).float(),
            beta=self.beta,
            desirable_weight=self.kto_desirable_weight,
            undesirable_weight=self.kto_undesirable_weight,
        )
        losses = out.losses
        if self.ftx > 0:  # on desirable answers only: the SFT term of LLaMA-Factory's KTO trainer
            losses = losses + self.ftx * torch.where(good, -logps / tokens.float(), 0.0)
        n_good = good.double().sum()
        n_bad = (~good).double().sum()
        detached = logps.detach().double()
        stats = {
            "rewards/chosen": (out.chosen_rewards.double().sum(), n_good),
            "rewards/rejected": (out.rejected_rewards.double().sum(), n_bad),
            "logps/chosen": (torch.where(good, detached, 0.0).sum(), n_good),
            "logps/rejected": (torch.where(good, 0.0, detached).sum(), n_bad),
            "kl": (kl.double() * half, torch.full((), half, dtype=torch.float64, device=logps.device)),
        }
        return Terms(losses, stats)
