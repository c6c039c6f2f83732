"""What a worker needs to join one attempt: a value built by the controller, sent to each actor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elastictrain.core.batch import BatchPlan


@dataclass(frozen=True)
class AttemptSpec:
    attempt: int
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    backend: str  # "gloo" on CPU, "nccl" on GPU
    plan: BatchPlan
    config: Any  # elastictrain.config.Config (kept Any: the config package is not needed to read this)
    ds_config: dict[str, Any]
    checkpoint_dir: str | None  # a committed checkpoint to load, or None for a fresh start
    start_step: int
    ranks_on_node: int = 1  # this attempt's ranks on the worker's node: they share its host memory
