"""What the control loop sees of the worker group: replies with typed errors, and the group's interface.

Ray-free, so the loop (and its unit tests, with the fake group of testing/fake_group.py) never import Ray.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from elastictrain.cluster.worker_api import WorkerMethod

# A call's outcome when it has no value: the actor's process died, its whole node went away, the
# method raised, or no answer came within the gather's timeout.
DIED, NODE_LOST, RAISED, TIMED_OUT = "died", "node_lost", "raised", "timed_out"
# The actor's process was killed by Ray's memory monitor: its node ran short of memory.
OUT_OF_MEMORY = "out_of_memory"


@dataclass(frozen=True)
class Reply:
    worker_id: str
    value: Any = None
    error: str = ""  # "" when the call returned; else DIED, NODE_LOST, OUT_OF_MEMORY, RAISED or TIMED_OUT
    detail: str = ""  # the error's text (a worker's traceback ends with "Type: message")
    node_id: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


class Worker(Protocol):
    """One worker actor as the loop knows it."""

    @property
    def worker_id(self) -> str: ...
    @property
    def node_id(self) -> str: ...
    @property
    def actor_id(self) -> str: ...
    @property
    def info(self) -> dict[str, Any]: ...


Calls = dict[str, Any]  # worker id -> the pending call (opaque to the loop)


class Group(Protocol):
    """The worker group: reservations, actors and calls. cluster/worker_group.py on Ray."""

    @property
    def workers(self) -> list[Any]: ...
    @property
    def pending(self) -> list[Any]: ...
    @property
    def warm_workers(self) -> list[Any]: ...
    @property
    def warming(self) -> list[Any]: ...
    @property
    def warmup_errors(self) -> list[tuple[str, str]]:
        """(worker id, error) of each warm-up that raised (not of actors that died): oldest first."""
        ...

    def request(self, n: int) -> None: ...
    def ready_reservations(self, timeout_s: float = 0.0) -> int: ...
    def wait_for_reservations(self, n: int, timeout_s: float) -> int: ...
    def start_workers(self, limit: int, config: Any) -> list[Any]: ...
    def poll_warm(self, timeout_s: float = 0.0, n: int | None = None) -> list[Any]: ...
    def remove(self, handle: Any, *, kill: bool = True) -> None: ...
    def avoid_node(self, node_id: str, seconds: float) -> None: ...
    def progress(self, timeout_s: float = 5.0) -> dict[str, dict[str, Any] | None]: ...
    def shutdown(self) -> None: ...

    def call(
        self,
        workers: Sequence[Any],
        method: WorkerMethod,
        *args: Any,
        control: bool = False,
        watch: bool = False,
    ) -> Calls:
        """`method(*args)` on every worker (`method` is one of WorkerApi's, worker_api.py); `control`
        answers even mid-step (a separate thread); `watch` too, on threads of its own, for calls that
        wait long (a write's end)."""
        ...

    def call_each(
        self, workers: Sequence[Any], method: WorkerMethod, args: Sequence[tuple[Any, ...]]
    ) -> Calls:
        """`method(*args[i])` on workers[i]."""
        ...

    def gather(
        self,
        calls: Calls,
        timeout_s: float,
        *,
        stop_on_error: bool = False,
        grace_s: float = 3.0,
    ) -> dict[str, Reply]:
        """Every call's reply, waiting up to timeout_s; the unanswered ones are TIMED_OUT.

        With stop_on_error the first error ends the wait after grace_s more for the others: the
        first error seen may be a survivor's broken collective, the root cause arrives just after.
        A dead worker whose node is gone is NODE_LOST (one cluster query for all of them).
        """
        ...

    def nodes_alive(self) -> set[str]:
        """The ids of the cluster's live nodes (one cluster query)."""
        ...


class WorkerViews:
    """What every group derives alike from its `workers` (each with a `warm` flag)."""

    workers: list[Any]

    @property
    def warm_workers(self) -> list[Any]:
        """Workers ready to join an attempt, in the order they became ready."""
        return [w for w in self.workers if w.warm]

    @property
    def warming(self) -> list[Any]:
        """Workers still paying their one-time costs (imports, ops, data)."""
        return [w for w in self.workers if not w.warm]
