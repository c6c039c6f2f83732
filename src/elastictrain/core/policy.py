"""What the controller does after a failure, while short of capacity, and when capacity returns.

Decisions are values; the controller carries them out. Time comes in as an argument.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from elastictrain.core.batch import BatchPlan, plan_batch

FAILURE_KINDS = (
    "worker_died",
    "node_lost",
    "out_of_memory",
    "step_error",
    "hang",
    "setup_error",
    "straggler",
)


@dataclass(frozen=True)
class Failure:
    kind: str  # one of FAILURE_KINDS
    worker_ids: tuple[str, ...]  # the workers at fault (dead, hung, or raising)
    step: int  # the step that was running
    message: str
    detail: str = ""  # the worker's own error and traceback, when it raised


@dataclass(frozen=True)
class Restart:
    world_size: int
    reason: str


@dataclass(frozen=True)
class Wait:
    need: int  # workers needed in all (alive + new) before a restart can happen
    deadline: float  # clock value after which waiting ends in Fail
    reason: str


@dataclass(frozen=True)
class Fail:
    reason: str


Decision = Restart | Wait | Fail


@dataclass(frozen=True)
class ScalingRules:
    min_workers: int
    max_workers: int
    global_batch_size: int
    micro_batch_size: int
    max_failures: int
    wait_for_capacity_s: float
    tensor_parallel: int = 1  # world sizes are whole replicas of tensor_parallel x pipeline_parallel ranks
    pipeline_parallel: int = 1

    @property
    def replica_ranks(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    def plan(self, world_size: int) -> BatchPlan | None:
        return plan_batch(
            self.global_batch_size,
            self.micro_batch_size,
            world_size,
            self.tensor_parallel,
            self.pipeline_parallel,
        )

    def best_size(self, capacity: int) -> int | None:
        """The largest world size within [min, max] and capacity that splits the global batch exactly."""
        for w in range(min(capacity, self.max_workers), self.min_workers - 1, -1):
            if self.plan(w) is not None:
                return w
        return None

    def smallest_workable(self) -> int | None:
        for w in range(self.min_workers, self.max_workers + 1):
            if self.plan(w) is not None:
                return w
        return None


def decide_start(rules: ScalingRules, capacity: int, now: float, waiting_since: float | None) -> Decision:
    """At a (re)start: run at the best size capacity allows, or wait for capacity up to the deadline."""
    size = rules.best_size(capacity)
    if size is not None:
        return Restart(size, f"{capacity} worker slot(s) available; running at world size {size}")
    need = rules.smallest_workable()
    if need is None:
        return Fail(
            f"no world size in [{rules.min_workers}, {rules.max_workers}] splits "
            f"training.global_batch_size={rules.global_batch_size} exactly"
        )
    started = now if waiting_since is None else waiting_since
    deadline = started + rules.wait_for_capacity_s
    if now >= deadline:
        return Fail(
            f"waited {rules.wait_for_capacity_s:.0f}s (failure.wait_for_capacity_s) for {need} workers "
            f"(scaling.min_workers={rules.min_workers}) but only {capacity} slot(s) are available; "
            "the run is resumable with `elastictrain resume` once capacity is back"
        )
    return Wait(need, deadline, f"{capacity} of the {need} workers needed are available")


# Failures a restart cannot cure when they recur: the same code raised on the same data.
DETERMINISTIC_KINDS = ("step_error", "setup_error")


def error_signature(message: str) -> str:
    """A failure message without what differs between attempts: worker ids, addresses, object ids."""
    text = re.sub(r"\b(raised in|of) [\w.-]+:", r"\1 <worker>:", message)
    return re.sub(r"0x[0-9a-fA-F]+|\b[0-9a-f]{16,}\b", "<id>", text)


def repeats_earlier_failure(failure: Failure, earlier: Sequence[Failure]) -> bool:
    """A raised error at the same step with the same message as before a restart: deterministic."""
    if failure.kind not in DETERMINISTIC_KINDS:
        return False
    sig = error_signature(failure.message)
    same = (e for e in earlier if e.kind == failure.kind and e.step == failure.step)
    return any(error_signature(e.message) == sig for e in same)


def repeated_warmup_error(errors: Sequence[tuple[str, str]]) -> str | None:
    """The run's end when warm-ups raise: the same error from two warm-ups (two workers, or a worker and
    its replacement) is the config's or the code's, not capacity's. None: keep starting workers."""
    seen: dict[str, str] = {}
    for worker_id, error in errors:
        sig = error_signature(error)
        if sig in seen:
            return (
                f"workers failed while warming up with the same error ({seen[sig]}, {worker_id}): "
                f"{error.strip()}"
            )
        seen[sig] = worker_id
    return None


def decide_after_failure(
    rules: ScalingRules,
    failure: Failure,
    failures_so_far: int,
    capacity: int,
    now: float,
    earlier: Sequence[Failure] = (),
) -> Decision:
    """`failures_so_far` counts this failure; `capacity` is surviving workers plus ready reservations.

    Two rules, named in the reason: an error that recurs unchanged at the same step after a restart
    is deterministic and stops the run at once; any other failure (a worker or node lost, a hang, an
    error seen once) is retried within failure.max_failures.
    """
    if repeats_earlier_failure(failure, earlier):
        return Fail(
            f"deterministic error (rule: the same error at the same step after a restart is not retried): "
            f"step {failure.step} raised again: {failure.message}"
        )
    if failures_so_far > rules.max_failures:
        return Fail(
            f"failure budget spent (rule: transient failures are retried up to failure.max_failures): "
            f"{failures_so_far} failures > failure.max_failures={rules.max_failures} "
            f"(last: {failure.kind} of {', '.join(failure.worker_ids) or 'the group'} "
            f"at step {failure.step}: {failure.message})"
        )
    return decide_start(rules, capacity, now, None)


def ceiling_after_out_of_memory(rules: ScalingRules, world_size: int) -> ScalingRules | Fail:
    """Rules for the rest of the run after a worker was killed for memory at `world_size`.

    Ranks that share a node share its memory, so the run goes on at the largest smaller size that
    splits the global batch, and does not grow back to the size that ran out (until it is resumed).
    Where each rank has a node of its own a smaller size does not help, and the next kill lowers the
    ceiling again until scaling.min_workers, where the run ends with what to change.
    """
    lowered = replace(rules, max_workers=world_size - 1)
    if lowered.max_workers >= rules.min_workers and lowered.smallest_workable() is not None:
        return lowered
    return Fail(
        f"out of memory (rule: a size at which a worker was killed for memory is not tried again): "
        f"a worker was killed at world size {world_size} and no smaller size in "
        f"[scaling.min_workers={rules.min_workers}, {world_size - 1}] splits "
        f"training.global_batch_size={rules.global_batch_size} exactly; lower the memory per rank "
        "(deepspeed.offload_optimizer=cpu or nvme, deepspeed.offload_param=nvme, a smaller "
        "training.micro_batch_size, deepspeed.activation_checkpointing=true) or give the workers more memory"
    )


def decide_grow(rules: ScalingRules, world_size: int, capacity: int) -> int | None:
    """A larger world size to move to now that `capacity` slots exist, or None to stay."""
    size = rules.best_size(capacity)
    return size if size is not None and size > world_size else None
