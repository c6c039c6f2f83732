"""`--local`'s worker group: one in-process worker answering the control loop as a Ray actor would."""

from __future__ import annotations

import threading
from typing import Any

from elastictrain.cluster.calls import RAISED, TIMED_OUT
from elastictrain.cluster.local_group import LocalGroup
from elastictrain.cluster.worker_api import WorkerApi


class ScriptedWorker:
    """The methods the loop calls, with a step that can be held mid-way."""

    def __init__(self, worker_id: str, use_gpu: bool) -> None:
        self.worker_id = worker_id
        self.order: list[str] = []
        self.release = threading.Event()
        self.started = threading.Event()
        self.torn_down = 0

    def warmup(self, config: Any) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "actor_id": "local", "node_id": "local", "node_ip": "127.0.0.1"}

    def train_step(self, step: int) -> dict[str, Any]:
        self.order.append(f"step {step}")
        self.started.set()
        if step == 99:
            self.release.wait(5.0)
        if step == 13:
            raise ValueError("bad batch at step 13")
        return {"step": step}

    def progress(self) -> dict[str, Any]:
        return {"mark": "step"}

    def teardown(self) -> None:
        self.torn_down += 1


def _warm_group() -> tuple[LocalGroup, Any]:
    group = LocalGroup(use_gpu=False, make_worker=ScriptedWorker)
    group.request(4)  # one slot is all there is
    assert group.ready_reservations() == 1
    started = group.start_workers(4, config=None)
    assert len(started) == 1
    assert group.poll_warm(timeout_s=5.0) == started
    return group, started[0]


def test_the_group_has_one_slot_and_its_worker_warms_up_with_an_identity():
    group, worker = _warm_group()
    assert worker.node_id == "local" and worker.info["node_ip"] == "127.0.0.1"
    group.request(1)
    assert group.ready_reservations() == 0, "no second slot while the worker holds the first"
    group.shutdown()


def test_calls_run_in_order_and_a_raising_step_replies_raised_with_its_traceback():
    group, w = _warm_group()
    calls = [group.call([w], WorkerApi.train_step, step) for step in (11, 12, 13)]
    replies = [group.gather(c, timeout_s=5.0)[w.worker_id] for c in calls]
    assert w.actor.order == ["step 11", "step 12", "step 13"]
    assert [r.value for r in replies[:2]] == [{"step": 11}, {"step": 12}]
    assert replies[2].error == RAISED
    assert "Traceback" in replies[2].detail and "ValueError: bad batch at step 13" in replies[2].detail
    group.shutdown()


def test_progress_answers_while_a_step_runs_and_an_unfinished_call_times_out():
    group, w = _warm_group()
    held = group.call([w], WorkerApi.train_step, 99)
    # Behind the held step (5 s) the answer would come too late: None. The control lane answers now.
    assert group.progress(timeout_s=2.0) == {w.worker_id: {"mark": "step"}}
    assert group.gather(held, timeout_s=0.1)[w.worker_id].error == TIMED_OUT
    w.actor.release.set()
    assert group.gather(held, timeout_s=5.0)[w.worker_id].value == {"step": 99}
    group.shutdown()


def test_shutdown_tears_the_worker_down_after_its_running_step():
    group, w = _warm_group()
    group.call([w], WorkerApi.train_step, 99)
    assert w.actor.started.wait(5.0)
    threading.Timer(0.2, w.actor.release.set).start()
    group.shutdown()
    assert w.actor.order == ["step 99"] and w.actor.torn_down == 1
    assert group.workers == []
