"""What a worker needs to join one attempt: a value built by the controller, sent to each actor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elastictrain.core.batch import BatchPlan
from elastictrain.data.preference.reference import ReferenceTable


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
    snapshot_every: int = 0  # copy the state to host memory after every this many steps (0: never)
    buddy: Any = None  # the actor that holds this rank's in-memory snapshots too (None: nobody)
    memory: MemorySource | None = None  # load from the old ranks' in-memory snapshots instead of disk
    # A full fine-tune's precomputed reference log-probabilities (preference objectives), once computed
    reference: ReferenceTable | None = None


@dataclass(frozen=True)
class MemorySource:
    """Where a new attempt's ranks find the state after `step` steps: the holder of each old rank."""

    attempt: int
    world_size: int
    step: int
    holders: dict[int, tuple[str, Any]]  # old rank -> (worker id, actor handle)
