"""Who stalled a hung group, from a snapshot of what the controller observed of each worker.

Pure and O(workers): when a step or a save gets no answer in time, the controller gathers the
observations (actor liveness, node liveness, each worker's last progress mark, whether it waits
inside a collective; control/failures.py) and this names the workers at fault.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerObservation:
    worker_id: str
    answering: bool  # the actor answered its control channel
    node_alive: bool
    last_progress: float  # clock value of the worker's last progress mark
    step: int
    in_collective: bool = False  # blocked waiting for other ranks (a victim of a stall, not its cause)


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
