"""How a Ray call's outcome becomes a typed reply: the exceptions are Ray's own, raised by `ray.get`."""

from __future__ import annotations

import pytest
from ray.exceptions import ActorDiedError, GetTimeoutError, OutOfMemoryError

import elastictrain.cluster.ray_replies as ray_replies
from elastictrain.cluster.calls import DIED, OUT_OF_MEMORY, TIMED_OUT

RAY_OOM_MESSAGE = (
    "Task was killed due to the node running low on memory.\n"
    "Memory on the node (IP: 10.0.0.7, ID: 5f3c) where the task (actor ID: 9a1b, name=TrainWorker.__init__, "
    "pid=2071, memory used=7.9GB) was running was 22.9GB / 24.0GB (0.954), which exceeds the memory usage "
    "threshold of 0.95. Ray killed this worker (ID: 77aa) because it was the most recently scheduled task"
)


@pytest.mark.parametrize(
    ("raised", "error"),
    [
        (OutOfMemoryError(RAY_OOM_MESSAGE), OUT_OF_MEMORY),
        (ActorDiedError(), DIED),
        (GetTimeoutError("not yet"), TIMED_OUT),
    ],
)
def test_a_worker_killed_by_rays_memory_monitor_is_told_apart_from_a_death_and_a_raised_error(
    monkeypatch: pytest.MonkeyPatch, raised: Exception, error: str
):
    def get(ref: object, timeout: float) -> object:
        raise raised

    monkeypatch.setattr(ray_replies.ray, "get", get)
    reply = ray_replies.reply_of("w1", object())
    assert reply.error == error


def test_the_out_of_memory_failure_names_how_full_the_node_was():
    from elastictrain.control.failures import memory_report

    assert memory_report(RAY_OOM_MESSAGE).startswith("Memory on the node (IP: 10.0.0.7")
    assert "22.9GB / 24.0GB" in memory_report(RAY_OOM_MESSAGE)
    assert memory_report("") == "the node ran short of memory"
    # As Ray 2.60 words it (from a real kill on this machine), the kill reason and store figures go.
    ray_260 = (
        "Task was killed due to the node running low on memory.\nMemory on the node (IP: 192.0.2.2, ID: "
        "88890c6547a81a0ee297fb79fac5667ba68f6c0cb36338ce057b1cd3) was 18.57GB used / 23.54GB limit "
        "(0.788682) OOM kill reason: Memory usage 19852529664B "
        "exceeded threshold of 19715670016B (78.0% of 25276502016B limit) Object store memory usage: [- "
        "objects spillable: 0]"
    )
    assert memory_report(ray_260).endswith("18.57GB used / 23.54GB limit (0.788682)")


def test_workers_get_the_drivers_malloc_tunables_and_cpu_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from elastictrain.cluster.worker_resources import WorkerResources

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    monkeypatch.setenv("UNRELATED_SETTING", "x")
    env = WorkerResources(use_gpu=False, cpus_per_worker=2, gpus_per_worker=0).env_vars()
    assert env["MALLOC_MMAP_THRESHOLD_"] == "131072" and "UNRELATED_SETTING" not in env
    assert env["OMP_NUM_THREADS"] == "2" and env["DS_ACCELERATOR"] == "cpu"
