"""The checks of `training.objective` and the `preference` section when the config is loaded.

The records themselves (pairs, KTO examples) are read and checked on the driver before any worker
starts (driver/preflight.py), as supervised fine-tuning's are.
"""

from __future__ import annotations

from typing import Any

from elastictrain.core.objectives import OBJECTIVES, WITH_REFERENCE

DPO_LOSSES = ("sigmoid", "hinge", "ipo")
REFERENCES = ("auto", "adapters", "precomputed")


def objective_problems(config: Any) -> list[str]:
    """One line per problem, naming the field, the value and what would be valid."""
    t, p, pref = config.training, [], config.preference
    if t.objective not in OBJECTIVES:
        return [
            f"training.objective: got {t.objective!r}; expected lm (causal LM, supervised fine-tuning), dpo, "
            "orpo, simpo (preference pairs) or kto (answers marked desirable or not)"
        ]
    if t.objective == "lm":
        return p
    if config.data.source != "sft":
        p.append(
            f"data.source: got {config.data.source!r}; training.objective {t.objective} reads preference "
            "records: expected sft (data.dataset_dir + data.dataset, or data.path)"
        )
    if t.loss is not None:
        p.append(
            f"training.loss: got {t.loss!r}; training.objective {t.objective} is the loss. Set one of them"
        )
    if pref.dpo_loss not in DPO_LOSSES:
        p.append(f"preference.dpo_loss: got {pref.dpo_loss!r}; expected one of {', '.join(DPO_LOSSES)}")
    if not pref.beta > 0:
        p.append(f"preference.beta: got {pref.beta!r}; expected a number > 0")
    if not 0 <= pref.label_smoothing < 0.5:
        p.append(
            f"preference.label_smoothing: got {pref.label_smoothing!r}; expected a number in [0, 0.5) (the "
            "share of pairs assumed flipped)"
        )
    elif pref.label_smoothing > 0 and not (
        t.objective == "simpo" or (t.objective == "dpo" and pref.dpo_loss == "sigmoid")
    ):
        p.append(
            f"preference.label_smoothing: got {pref.label_smoothing}; only dpo's sigmoid loss and simpo use "
            f"it, not {t.objective}{' ' + pref.dpo_loss if t.objective == 'dpo' else ''}; set it to 0"
        )
    if not pref.ftx >= 0:
        p.append(f"preference.ftx: got {pref.ftx!r}; expected a number >= 0 (0: no SFT term)")
    for key in ("kto_desirable_weight", "kto_undesirable_weight"):
        if not getattr(pref, key) > 0:
            p.append(f"preference.{key}: got {getattr(pref, key)!r}; expected a number > 0")
    p.extend(_reference_problems(config))
    return p


def _reference_problems(config: Any) -> list[str]:
    t, ref = config.training, config.preference.reference
    if ref not in REFERENCES:
        return [
            f"preference.reference: got {ref!r}; expected auto (adapters for LoRA runs, else precomputed), "
            "adapters (the model with its LoRA adapters off) or precomputed (the starting model's "
            "log-probabilities, computed once before the first step)"
        ]
    if t.objective not in WITH_REFERENCE:
        return []
    if ref == "adapters" and not config.model.lora.enabled:
        return [
            "preference.reference: got 'adapters', but model.lora.enabled is false: a full fine-tune has no "
            "adapters to switch off; expected precomputed (or auto)"
        ]
    precomputed = ref == "precomputed" or (ref == "auto" and not config.model.lora.enabled)
    if precomputed and config.eval.data is not None:
        return [
            "eval.data: a validation source of its own has no precomputed reference log-probabilities "
            "(they cover the training data); use eval.split for a held-out share of it, or LoRA "
            "(preference.reference adapters)"
        ]
    return []
