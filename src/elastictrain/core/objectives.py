"""Training objectives: which exist, which need a reference, and where a run's reference comes from.

Pure: the config checks, the driver (whether a reference pass is due) and the workers share these.
"""

from __future__ import annotations

from typing import Any

PAIR_OBJECTIVES = ("dpo", "orpo", "simpo")  # items are (chosen, rejected) pairs
OBJECTIVES = ("lm", *PAIR_OBJECTIVES, "kto")
WITH_REFERENCE = ("dpo", "kto")  # ORPO and SimPO are reference-free


def reference_kind(objective: str, setting: str, lora: bool) -> str:
    """adapters | precomputed | none: what `preference.reference` means for this objective and model."""
    if objective not in WITH_REFERENCE:
        return "none"
    if setting == "auto":
        return "adapters" if lora else "precomputed"
    return setting


def run_reference(config: Any) -> str:
    """The reference a run's config asks for (adapters | precomputed | none)."""
    lora = bool(config.model.lora.enabled)
    return reference_kind(config.training.objective, config.preference.reference, lora)
