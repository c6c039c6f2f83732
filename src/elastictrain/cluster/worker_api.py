"""What the driver may ask of a worker: the one list of worker methods a group call can name.

A call names the method itself (`group.call(ws, WorkerApi.train_step, step)`), never a string, so a
rename here or on the worker is caught where the call is written: by the type checker, and by
tests/unit/test_worker_api.py, which checks the Ray actor and the fake group answer every method.
Ray-free and torch-free: the driver and the loop's unit tests import it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class WorkerApi(Protocol):
    """The worker actor as the driver sees it (worker/actor.py implements it)."""

    # -- identity and health: answered on the control lane, even mid-step
    def info(self) -> dict[str, Any]: ...
    def progress(self) -> dict[str, Any]: ...
    def abort_collectives(self) -> int: ...

    # -- joining and leaving runs and attempts
    def warmup(self, config: Any, worker_id: str | None = None) -> dict[str, Any]: ...
    def free_port(self) -> int: ...
    def setup(self, spec: Any) -> dict[str, float]: ...
    def teardown(self) -> dict[str, float]: ...
    def leave_run(self) -> dict[str, float]: ...

    # -- training
    def train_step(
        self, step: int, snapshot: bool | None = None, probe: bool = False, skip: bool = False
    ) -> dict[str, Any]: ...
    def evaluate(self, step: int) -> dict[str, Any]: ...

    # -- checkpoints on disk
    def save_shard(self, staging_dir: str, background: bool = False) -> dict[str, Any]: ...
    def save_status(self, staging_dir: str, wait_s: float = 0.0) -> dict[str, Any]: ...

    # -- in-memory snapshots
    def snapshot_now(self) -> dict[str, Any]: ...
    def memory_holdings(self) -> list[dict[str, Any]]: ...
    def hand_off_snapshots(self, target: Any) -> int: ...

    # -- a preference run's reference log-probabilities
    def reference_items(self) -> dict[str, Any]: ...
    def reference_logps(self, start: int, stop: int) -> dict[str, Any]: ...
    def use_reference(self, table: Any) -> None: ...


WorkerMethod = Callable[..., Any]


def method_name(method: WorkerMethod) -> str:
    """The name a group sends for `method`, which must be one of WorkerApi's."""
    name = getattr(method, "__name__", None)
    if not isinstance(name, str) or getattr(WorkerApi, name, None) is not method:
        raise TypeError(
            f"a group call names a WorkerApi method (e.g. WorkerApi.train_step), got {method!r}; "
            f"the worker's methods: {', '.join(driver_methods())}"
        )
    return name


def driver_methods() -> list[str]:
    """Every method the driver may call, in the order WorkerApi lists them."""
    return [n for n, v in vars(WorkerApi).items() if callable(v) and not n.startswith("_")]
