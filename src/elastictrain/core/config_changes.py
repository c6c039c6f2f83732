"""Which config changes a run may take when it is resumed, and why the others would break it.

A checkpoint holds the model's weights, the optimizer's state and a position in the global data
order. A change is safe mid-run when what was saved stays valid and the steps after the resume
compute what they would have computed: how long to train (and so the LR schedule's length), how
many workers and where, how often to checkpoint, how to react to failures, where to log, and how
each rank holds the state (ZeRO stage, offload, micro-batch size: the global batch stays the same),
and the compute precision between fp32 and bf16 (a run moved from a CPU to a GPU and back).
Anything that changes the model's shape, the global batch, the data or its order, the optimizer
or the numbers it computes is refused, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SAFE_PREFIXES = ("scaling.", "checkpoint.", "failure.", "tracking.", "ray.")
SAFE_KEYS = {
    "training.max_steps": "how long to train (the LR schedule's length)",
    "training.num_epochs": "how long to train, in passes over the data (training.max_steps follows)",
    "training.epoch_samples": "the training set's size that num_epochs counts, recorded at start",
    "training.log_every_steps": "how often to log",
    "training.micro_batch_size": "a rank's memory cap; the global batch stays the same",
    "deepspeed.zero_stage": "how ranks hold the state; checkpoints load under any stage",
    "deepspeed.offload_optimizer": "where the optimizer state lives",
    "deepspeed.offload_param": "where the parameters live",
    "deepspeed.nvme_path": "where NVMe offload swaps",
    "deepspeed.activation_checkpointing": "memory against recomputation; the numbers stay the same",
    "eval.every_steps": "how often to validate",
    "eval.steps": "how much of the validation set each evaluation reads",
    "eval.prompts": "what the model is asked at each validation",
    "eval.max_new_tokens": "how long each completion may be",
    "eval.chat_template": "how string prompts are formatted",
}
# Keys that may change between some values only: key -> (those values, why the change is safe).
SAFE_BETWEEN = {
    "training.precision": (
        frozenset({"fp32", "bf16"}),
        "the compute precision; checkpoints hold fp32 master weights and optimizer state in either",
    ),
}
REFUSED_PREFIXES = {
    "model.": "the model's shape and weights",
    "data.": "the data and its order",
    "eval.split": "which samples training reads (the held-out ones are not)",
    "eval.data": "the validation set, so evaluations before and after would not compare",
    "training.global_batch_size": "the global batch",
    "training.seed": "the data order",
    "training.precision": "fp16's loss scale, which fp32 and bf16 do not carry (fp32 <-> bf16 may change)",
    "training.": "what the optimizer computes",
    "preference.": "the preference loss, and what the kept reference log-probabilities mean",
    "deepspeed.": "what the optimizer computes",
    "run.": "the run's identity and folder",
}


@dataclass(frozen=True)
class ConfigChanges:
    allowed: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # key -> (before, after)
    refused: dict[str, str] = field(default_factory=dict)  # key -> why it cannot change

    def refusal(self) -> str:
        lines = [f"{key}: cannot change when resuming; it changes {why}" for key, why in self.refused.items()]
        return "\n".join(lines)


def classify_changes(before: dict[str, Any], after: dict[str, Any]) -> ConfigChanges:
    """Compare two flat configs ({"training.max_steps": 40, ...}) key by key."""
    allowed: dict[str, tuple[Any, Any]] = {}
    refused: dict[str, str] = {}
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key), after.get(key)
        if old == new:
            continue
        if key in SAFE_KEYS or key.startswith(SAFE_PREFIXES):
            allowed[key] = (old, new)
            continue
        values = SAFE_BETWEEN.get(key, (frozenset(), ""))[0]
        if old in values and new in values:
            allowed[key] = (old, new)
            continue
        refused[key] = next(
            (why for prefix, why in REFUSED_PREFIXES.items() if key.startswith(prefix)), "the run"
        )
    return ConfigChanges(allowed, refused)


def extension_problem(last_step: int, max_steps: int, num_epochs: float | None = None) -> str | None:
    """A resume that shortens a run below what it already trained is refused (naming what was set)."""
    if max_steps < last_step:
        given = f"training.num_epochs: got {num_epochs:g} ({max_steps} steps)" if num_epochs else None
        return (
            f"{given or f'training.max_steps: got {max_steps}'}; the run has already trained {last_step} "
            f"steps (expected >= {last_step})"
        )
    return None
