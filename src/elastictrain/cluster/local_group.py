"""The worker group of `--local`: one worker in this process, no Ray, driven by the same control loop.

The loop (control/loop.py) sees a group of one slot. The worker is the same TrainWorker class a Ray
actor hosts; its calls run on threads as an actor's would: calls of the default lane one after
another, in order, on one thread, and the `control` and `watch` lanes on threads of their own, so
the loop's progress checks and a save's wait answer while a step runs. A call that raises replies
RAISED with its traceback, as a Ray actor's does; nothing here can die without the driver.
"""

from __future__ import annotations

import itertools
import logging
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from elastictrain.cluster.calls import RAISED, TIMED_OUT, Calls, Reply, WorkerViews
from elastictrain.cluster.worker_api import WorkerApi, WorkerMethod, method_name

log = logging.getLogger("elastictrain.workers")
LOCAL_NODE = "local"


@dataclass
class LocalHandle:
    """The one worker, as the loop knows a worker: an id, its node, its identity, whether it is warm."""

    worker_id: str
    actor: Any  # the TrainWorker itself
    info: dict[str, Any] = field(default_factory=dict)
    warm_call: Future[Any] | None = None
    warm: bool = False

    @property
    def actor_id(self) -> str:
        return str(self.info.get("actor_id", ""))

    @property
    def node_id(self) -> str:
        return str(self.info.get("node_id", LOCAL_NODE))


class LocalGroup(WorkerViews):
    """Implements cluster.calls.Group with one slot, filled by a TrainWorker in this process."""

    def __init__(self, use_gpu: bool, make_worker: Callable[[str, bool], Any] | None = None) -> None:
        self.use_gpu = use_gpu
        self.workers: list[LocalHandle] = []
        self.pending: list[int] = []  # the one slot, until its worker starts
        self.warmup_errors: list[tuple[str, str]] = []
        self._make_worker = make_worker or _train_worker
        self._ids = itertools.count()
        # An actor's lanes: its default one runs calls one at a time, in order.
        self._lanes = {
            "default": ThreadPoolExecutor(1, thread_name_prefix="et-local-step"),
            "control": ThreadPoolExecutor(2, thread_name_prefix="et-local-control"),
            "watch": ThreadPoolExecutor(2, thread_name_prefix="et-local-watch"),
        }

    # -- the slot --
    def request(self, n: int) -> None:
        free = 1 - len(self.workers) - len(self.pending)
        self.pending.extend(range(max(0, min(n, free))))

    def ready_reservations(self, timeout_s: float = 0.0) -> int:
        return len(self.pending)

    def wait_for_reservations(self, n: int, timeout_s: float) -> int:
        return len(self.pending)

    def release_pending(self, keep: int = 0) -> None:
        del self.pending[keep:]

    def start_workers(self, limit: int, config: Any) -> list[LocalHandle]:
        new = []
        while self.pending and len(new) < limit:
            self.pending.pop()
            worker_id = f"local-w{next(self._ids)}"
            worker = self._make_worker(worker_id, self.use_gpu)
            handle = LocalHandle(worker_id, worker)
            handle.warm_call = self._lanes["default"].submit(worker.warmup, config)
            new.append(handle)
        self.workers.extend(new)
        return new

    def poll_warm(self, timeout_s: float = 0.0, n: int | None = None) -> list[LocalHandle]:
        cold = [w for w in self.warming if w.warm_call is not None]
        if not cold:
            return []
        wait([w.warm_call for w in cold if w.warm_call is not None], timeout=timeout_s)
        became_warm = []
        for w in cold:
            assert w.warm_call is not None
            if not w.warm_call.done():
                continue
            try:
                w.info = w.warm_call.result()
                w.warm, w.warm_call = True, None
                became_warm.append(w)
            except Exception as e:  # noqa: BLE001 - a worker that cannot warm up is not usable
                log.warning("worker %s failed to start: %s", w.worker_id, e)
                self.warmup_errors.append((w.worker_id, f"{type(e).__name__}: {e}"))
                self.remove(w)
        return became_warm

    def avoid_node(self, node_id: str, seconds: float) -> None:
        """One process, one node: nothing to place elsewhere."""

    def remove(self, handle: LocalHandle, *, kill: bool = True) -> None:
        if handle in self.workers:
            self.workers.remove(handle)
        if kill:  # what killing an actor frees: its engine and process group
            try:
                handle.actor.teardown()
            except Exception as e:  # noqa: BLE001 - never set up, or torn down already
                log.debug("teardown of %s: %s", handle.worker_id, e)

    def progress(self, timeout_s: float = 5.0) -> dict[str, dict[str, Any] | None]:
        calls = self.call(self.workers, WorkerApi.progress, control=True)
        return {wid: (r.value if r.ok else None) for wid, r in self.gather(calls, timeout_s).items()}

    # -- calls --
    def call(
        self,
        workers: Sequence[LocalHandle],
        method: WorkerMethod,
        *args: Any,
        control: bool = False,
        watch: bool = False,
    ) -> Calls:
        lane = self._lanes["control" if control else "watch" if watch else "default"]
        name = method_name(method)
        return {w.worker_id: lane.submit(_traced, getattr(w.actor, name), args) for w in workers}

    def call_each(
        self, workers: Sequence[LocalHandle], method: WorkerMethod, args: Sequence[tuple[Any, ...]]
    ) -> Calls:
        lane, name = self._lanes["default"], method_name(method)
        return {
            w.worker_id: lane.submit(_traced, getattr(w.actor, name), a)
            for w, a in zip(workers, args, strict=True)
        }

    def gather(
        self,
        calls: Calls,
        timeout_s: float,
        *,
        stop_on_error: bool = False,
        grace_s: float = 3.0,
    ) -> dict[str, Reply]:
        pending: dict[Future[Any], str] = {future: wid for wid, future in calls.items()}
        replies: dict[str, Reply] = {}
        deadline = time.monotonic() + timeout_s
        while pending:
            left = max(0.0, deadline - time.monotonic())
            done, _ = wait(
                list(pending),
                timeout=left,
                return_when=FIRST_COMPLETED,
            )
            for future in done:
                wid = pending.pop(future)
                replies[wid] = _reply(wid, future)
            if stop_on_error and any(not r.ok for r in replies.values()):
                wait(list(pending), timeout=grace_s)
                for future, wid in pending.items():
                    replies[wid] = _reply(wid, future) if future.done() else _timed_out(wid, timeout_s)
                pending.clear()
            if pending and time.monotonic() >= deadline:
                break
        for wid in pending.values():
            replies[wid] = _timed_out(wid, timeout_s)
        return replies

    def nodes_alive(self) -> set[str]:
        return {LOCAL_NODE}

    def shutdown(self) -> None:
        # The step lane first: a step still running ends before its engine is released.
        for lane in self._lanes.values():
            lane.shutdown(wait=True, cancel_futures=True)
        for w in list(self.workers):
            self.remove(w)
        self.release_pending()


class _CallRaised(Exception):
    """A worker method's exception, carrying its traceback text (what a Ray actor's error says)."""


def _traced(method: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    try:
        return method(*args)
    except Exception as e:
        raise _CallRaised(traceback.format_exc().rstrip()) from e


def _reply(worker_id: str, future: Future[Any]) -> Reply:
    try:
        return Reply(worker_id, future.result(timeout=0), node_id=LOCAL_NODE)
    except _CallRaised as e:
        return Reply(worker_id, error=RAISED, detail=str(e), node_id=LOCAL_NODE)
    except Exception as e:  # noqa: BLE001 - cancelled at shutdown
        return Reply(worker_id, error=RAISED, detail=f"{type(e).__name__}: {e}", node_id=LOCAL_NODE)


def _timed_out(worker_id: str, timeout_s: float) -> Reply:
    return Reply(worker_id, error=TIMED_OUT, detail=f"no answer in {timeout_s:.0f}s", node_id=LOCAL_NODE)


def _train_worker(worker_id: str, use_gpu: bool) -> Any:
    from elastictrain.worker.actor import TrainWorker

    return TrainWorker(worker_id, use_gpu, in_ray=False)
