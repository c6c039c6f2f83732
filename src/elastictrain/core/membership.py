"""Failure detection over a snapshot of what the controller observed of each worker.

Pure and O(workers): the controller gathers the observations (actor liveness, node liveness, each
worker's last progress mark, whether it waits inside a collective) and this decides whether, and
which, workers failed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from elastictrain.core.policy import Failure


@dataclass(frozen=True)
class WorkerObservation:
    worker_id: str
    answering: bool  # the actor answered its control channel
    node_alive: bool
    last_progress: float  # clock value of the worker's last progress mark
    step: int
    in_collective: bool = False  # blocked waiting for other ranks (a victim of a stall, not its cause)


def detect_failure(
    observations: Sequence[WorkerObservation], now: float, hang_timeout_s: float, step: int
) -> Failure | None:
    lost = [o.worker_id for o in observations if not o.node_alive]
    if lost:
        return Failure("node_lost", tuple(lost), step, f"node of {', '.join(lost[:8])} lost")
    dead = [o.worker_id for o in observations if not o.answering]
    if dead:
        return Failure("worker_died", tuple(dead), step, f"worker(s) {', '.join(dead[:8])} stopped answering")
    if not observations:
        return None
    oldest = min(o.last_progress for o in observations)
    if now - oldest <= hang_timeout_s:
        return None
    stalled = stalled_workers(observations)
    return Failure(
        "hang",
        stalled,
        step,
        f"no progress for {now - oldest:.0f}s (failure.hang_timeout_s={hang_timeout_s:.0f}); "
        f"stalled: {', '.join(stalled[:8])}",
    )


def stalled_workers(observations: Sequence[WorkerObservation]) -> tuple[str, ...]:
    """The ranks that stopped the group: those not waiting in a collective for the others.

    When every rank waits in a collective (or none does) the stacks tell nothing; then the ranks whose
    last progress mark is oldest (within half a second of it) are the suspects.
    """
    outside = tuple(o.worker_id for o in observations if not o.in_collective)
    if outside and len(outside) < len(observations):
        return outside
    oldest = min(o.last_progress for o in observations)
    return tuple(o.worker_id for o in observations if o.last_progress - oldest < 0.5)
