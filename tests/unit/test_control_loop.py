"""The control loop's save and failure paths, on the fake worker group: whole runs in milliseconds, no Ray."""

from __future__ import annotations

from pathlib import Path

import pytest
from loop_harness import at_step, make_run

from elastictrain.checkpoint.store import verify
from elastictrain.testing.chaos import wait_until_replacements_are_warm


def test_a_clean_run_finishes_with_every_checkpoint_committed(tmp_path: Path):
    r = make_run(tmp_path)
    summary = r.run()
    assert summary.status.value == "FINISHED" and summary.step == 12
    assert [e["tag"] for e in r.events("checkpoint")] == ["step-000004", "step-000008", "step-000012"]
    assert r.committed_step() == 12 and r.status == "FINISHED"
    assert verify(r.run_dir.checkpoints_dir / "step-000012").ok
    assert summary.world_sizes == [2] and r.group.workers == []  # shut down at the end


def test_a_rank_dying_at_a_step_restarts_from_the_last_checkpoint_on_the_survivor(tmp_path: Path):
    r = make_run(tmp_path, "scaling.min_workers=1", "checkpoint.memory_every_steps=0")
    r.group.die_at_step(rank=1, step=6)
    summary = r.run()
    assert summary.status.value == "FINISHED" and summary.failures == 1
    (failure,) = r.events("failure")
    assert failure["kind"] == "worker_died" and failure["step"] == 6
    restarted = r.events("attempt_started")[1]
    assert restarted["checkpoint"] == "step-000004" and restarted["world_size"] == 1
    assert r.events("recovered")[0]["steps_lost"] == 2
    assert r.committed_step() == 12


def test_a_restart_checkpoint_that_fails_its_check_beside_the_set_up_is_rejected_and_the_previous_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    import threading

    import elastictrain.control.resume as resume
    from elastictrain.testing.fake_group import FakeGroup

    r = make_run(tmp_path, "scaling.min_workers=1", "checkpoint.memory_every_steps=0")
    # Each check waits (a bounded time) for the set-up it runs beside: run before it, it would time out.
    setting_up, beside = threading.Event(), []
    real_setup, real_verify = FakeGroup._setup, resume.verify

    def setup(group: FakeGroup, w: object, spec: object) -> dict[str, float]:
        setting_up.set()
        return real_setup(group, w, spec)

    def verify_beside(path: Path):  # noqa: ANN202
        beside.append(setting_up.wait(timeout=10))
        setting_up.clear()
        return real_verify(path)

    monkeypatch.setattr(FakeGroup, "_setup", setup)
    monkeypatch.setattr(resume, "verify", verify_beside)

    def damage_step_8(controller: object) -> None:
        rank_file = sorted((r.run_dir.checkpoints_dir / "step-000008").glob("rank-*"))[0]
        data = bytearray(rank_file.read_bytes())
        data[0] ^= 0xFF
        rank_file.write_bytes(bytes(data))

    r.controller.callbacks.after_step.append(at_step(9, damage_step_8))
    r.group.die_at_step(rank=1, step=10)
    summary = r.run()
    assert summary.status.value == "FINISHED" and summary.failures == 1  # the rejection is no failure
    (rejected,) = r.events("checkpoint_rejected")
    assert rejected["tag"] == "step-000008" and "sha256 differs" in rejected["problems"][0]
    # Set up from step 8 while it was checked, then again from step 4 once it was rejected (a grow
    # follows from step 8 saved anew).
    starts = [e["checkpoint"] for e in r.events("attempt_started")]
    assert starts[:2] == [None, "step-000004"], starts
    assert r.events("resume")[-1]["tag"] == "step-000004"
    assert r.events("recovered")[0]["steps_lost"] == 6  # steps 5-10, not only those after step 8
    assert r.committed_step() == 12
    assert beside and all(beside), beside  # every check ran while the workers were being set up


@pytest.mark.parametrize("spares", [0, 1])
def test_a_spare_worker_replaces_a_dead_one_without_waiting_for_a_new_actor(tmp_path: Path, spares: int):
    r = make_run(tmp_path, "scaling.min_workers=2", f"scaling.spare_workers={spares}", capacity=3)
    r.group.die_at_step(rank=1, step=6)
    summary = r.run()
    assert summary.status.value == "FINISHED" and summary.failures == 1
    # Never more than max_workers train, spare or not.
    assert [e["world_size"] for e in r.events("attempt_started")] == [2, 2]
    first, after_failure = (e["workers"] for e in r.events("workers_starting"))
    restart = r.events("attempt_started")[1]
    if spares:
        # Three actors from the start; the spare, warm since then, joined the restart, and a new spare
        # started beside it (not waited for).
        assert first == ["fw0", "fw1", "fw2"] and after_failure == ["fw3"]
        assert restart["actors"] == ["actor-fw0", "actor-fw2"]
    else:  # the restart waited for a new actor to start and warm up
        assert first == ["fw0", "fw1"] and after_failure == ["fw2"]
        assert restart["actors"] == ["actor-fw0", "actor-fw2"]


def test_after_a_failure_survivors_abort_their_collectives_before_leaving_but_not_after_a_clean_run(
    tmp_path: Path,
):
    r = make_run(tmp_path, "scaling.min_workers=1", "scaling.max_workers=3", capacity=3)
    attempts: list = []
    r.controller.callbacks.after_attempt_start.append(lambda c: attempts.append(list(c.active)))
    r.group.die_at_step(rank=2, step=6)
    assert r.run().status.value == "FINISHED"
    first, last = attempts[0], attempts[-1]
    for w in first[:2]:  # the survivors: abort (their control thread), then leave, then the next attempt
        calls = w.calls[w.calls.index("train_step") :]
        assert calls.index("abort_collectives") < calls.index("teardown")
    for w in last:  # the last attempt ends cleanly: its workers leave without aborting
        since_setup = w.calls[len(w.calls) - w.calls[::-1].index("setup") :]
        assert "teardown" in since_setup and "abort_collectives" not in since_setup


def test_a_worker_killed_for_memory_shrinks_the_run_instead_of_restarting_at_the_size_that_ran_out(
    tmp_path: Path,
):
    r = make_run(tmp_path, "scaling.min_workers=1", "scaling.max_workers=3", capacity=3)
    r.group.killed_for_memory_at_step(rank=2, step=6)
    summary = r.run()
    assert summary.status.value == "FINISHED" and summary.failures == 1
    (failure,) = r.events("failure")
    assert failure["kind"] == "out_of_memory" and "Memory on the node" in failure["message"]
    (ceiling,) = r.events("memory_ceiling")
    assert ceiling["max_workers"] == 2
    # A slot is free again (the killed actor's), yet the run neither restarts at 3 nor grows back to it.
    assert summary.world_sizes == [3, 2] and not r.events("grow")
    assert r.committed_step() == 12


def test_a_worker_killed_for_memory_at_the_minimum_size_ends_the_run_saying_what_to_change(tmp_path: Path):
    r = make_run(tmp_path, "scaling.min_workers=2", "scaling.max_workers=2", capacity=3)
    r.group.killed_for_memory_at_step(rank=0, step=6)
    summary = r.run()
    assert summary.status.value == "FAILED" and summary.message.startswith("out of memory")
    assert "deepspeed.offload_optimizer" in summary.message and r.status == "FAILED"


def test_a_dead_worker_whose_node_is_gone_is_node_lost_found_with_one_cluster_query(tmp_path: Path):
    r = make_run(tmp_path, "scaling.min_workers=1")

    def lose_a_node(controller):
        r.group.lose_node_of(controller.active[1])
        r.group.node_queries = 0

    r.controller.callbacks.after_step.append(at_step(5, lose_a_node))
    assert r.run().status.value == "FINISHED"
    (failure,) = r.events("failure")
    assert failure["kind"] == "node_lost"
    assert r.group.node_queries == 1  # one query for the whole group, not one per worker


def test_below_the_minimum_the_run_waits_then_fails_clearly_and_stays_resumable(tmp_path: Path):
    r = make_run(
        tmp_path,
        "scaling.min_workers=3",
        "scaling.max_workers=3",
        "failure.wait_for_capacity_s=5",
        capacity=3,
    )

    def lose_a_node_for_good(controller):
        r.group.lose_node_of(controller.active[-1])
        r.group.capacity -= 1  # its slot is gone with it: 2 left, below scaling.min_workers=3

    r.controller.callbacks.after_step.append(at_step(5, lose_a_node_for_good))
    summary = r.run()
    assert summary.status.value == "FAILED" and r.status == "FAILED"
    (waiting,) = r.events("waiting_for_capacity")
    assert waiting["need"] == 3
    assert "failure.wait_for_capacity_s" in summary.message and "elastictrain resume" in summary.message
    assert r.committed_step() == 4  # resumable from the last commit before the loss


def test_a_hung_step_names_the_rank_that_is_not_waiting_in_a_collective(tmp_path: Path):
    r = make_run(tmp_path, "scaling.min_workers=1", "scaling.max_workers=3", capacity=3)
    r.group.hang_at_step(rank=2, step=5)
    assert r.run().status.value == "FINISHED"
    failure = r.events("failure")[0]
    assert failure["kind"] == "hang" and failure["workers"] == [r.group.removed[0]]
    assert "fw2" in failure["workers"]


def test_a_full_disk_during_a_background_write_skips_that_save_and_training_goes_on(tmp_path: Path):
    r = make_run(tmp_path)
    r.controller.callbacks.after_step.append(at_step(5, lambda c: r.group.write_fails(rank=1)))
    summary = r.run()
    assert summary.status.value == "FINISHED" and summary.failures == 0
    (failed,) = r.events("checkpoint_failed")
    assert failed["step"] == 8 and "No space left on device" in failed["reason"]
    assert failed["previous"] == "step-000004"
    assert [e["tag"] for e in r.events("checkpoint")] == ["step-000004", "step-000012"]
    assert len(r.events("attempt_started")) == 1  # no restart: the ranks are healthy
    assert not any(p.name.startswith(".") for p in r.run_dir.checkpoints_dir.iterdir())


def test_a_hung_background_write_is_a_hang_and_its_checkpoint_is_dropped(tmp_path: Path):
    r = make_run(tmp_path, "checkpoint.memory_every_steps=0")  # the restart below is the disk's
    r.controller.callbacks.after_step.append(at_step(5, lambda c: r.group.save_hangs(rank=0)))
    summary = r.run()
    assert summary.status.value == "FINISHED" and summary.failures == 1
    (failure,) = r.events("failure")
    assert failure["kind"] == "hang" and "checkpoint write of .staging-step-000008" in failure["message"]
    (abandoned,) = r.events("checkpoint_abandoned")
    assert abandoned["step"] == 8 and abandoned["written"] == 1 and abandoned["ranks"] == 2
    # The rank whose write hangs is at fault: it is replaced, its peer keeps its actor.
    assert failure["workers"] == ["fw0"] and r.group.removed[0] == "fw0"
    assert r.events("attempt_started")[1]["checkpoint"] == "step-000004"
    assert r.committed_step() == 12


def test_growth_while_a_save_is_in_flight_commits_it_before_the_larger_world_loads_it(tmp_path: Path):
    r = make_run(
        tmp_path,
        "scaling.min_workers=2",
        "scaling.max_workers=4",
        "checkpoint.memory_every_steps=0",
        capacity=2,
    )
    r.controller.callbacks.after_step.append(at_step(6, lambda c: r.group.add_capacity(2)))
    r.controller.callbacks.after_step.append(at_step(7, wait_until_replacements_are_warm))
    summary = r.run()
    assert summary.status.value == "FINISHED" and summary.failures == 0
    (grow,) = r.events("grow")
    assert grow["step"] == 8 and grow["world_size"] == 4
    committed = [e for e in r.events("checkpoint") if e["tag"] == "step-000008"]
    assert committed and r.run_dir.read_events().index(committed[0]) < r.run_dir.read_events().index(grow) + 2
    larger = r.events("attempt_started")[1]
    assert larger["world_size"] == 4 and larger["checkpoint"] == "step-000008"
    assert summary.world_sizes == [2, 4]
    assert not r.events("recovered") or r.events("recovered")[0]["steps_lost"] == 0


def test_a_failure_is_reported_to_on_failure_callbacks_before_it_is_handled(tmp_path: Path):
    r = make_run(tmp_path, "scaling.min_workers=1")
    r.group.raise_at_step(rank=0, step=2, error="ValueError: bad batch")
    seen = []
    r.controller.callbacks.on_failure.append(lambda c, f: seen.append((f.kind, c.recorder.status.value)))
    assert r.run().status.value == "FINISHED"
    assert seen == [("step_error", "RUNNING")]
    assert "bad batch" in r.events("failure")[0]["message"]


def test_the_failure_budget_spent_ends_the_run_failed_and_recorded(tmp_path: Path):
    r = make_run(tmp_path, "scaling.min_workers=1", "failure.max_failures=1", capacity=4)
    r.group.die_at_step(rank=0, step=2)
    r.group.die_at_step(rank=0, step=6)
    summary = r.run()
    assert summary.status.value == "FAILED" and "failure budget spent" in summary.message
    assert "2 failures > failure.max_failures=1" in summary.message
    assert r.status == "FAILED" and r.events("fail")
    assert r.committed_step() == 4  # resumable from the last commit before the second failure


def test_a_step_error_counts_against_the_failure_budget_like_a_lost_worker(tmp_path: Path):
    # What tests/integration/test_elastic.py shows with a real worker raising: the same classification
    # (step_error), each error one failure, the run failed once the budget is spent and still resumable.
    r = make_run(tmp_path, "scaling.min_workers=1", "failure.max_failures=1", capacity=4)
    r.group.raise_at_step(rank=0, step=2, error="RuntimeError: injected fault at step 2")
    r.group.raise_at_step(rank=1, step=6, error="RuntimeError: injected fault at step 6")
    summary = r.run()
    assert [e["kind"] for e in r.events("failure")] == ["step_error", "step_error"]
    assert summary.status.value == "FAILED" and "2 failures > failure.max_failures=1" in summary.message
    assert r.committed_step() == 4


def test_a_step_that_raises_the_same_error_again_after_a_restart_stops_the_run_at_once(tmp_path: Path):
    r = make_run(tmp_path, "scaling.min_workers=1", "failure.max_failures=5")
    error = "AttributeError: 'DeepSpeedZeRoOffload' object has no attribute 'param_groups'"
    r.group.raise_at_step(rank=0, step=6, error=error)
    r.group.raise_at_step(rank=0, step=6, error=error)  # the same error when step 6 runs again
    summary = r.run()
    assert summary.status.value == "FAILED" and summary.failures == 2  # one restart, not five
    assert summary.message.startswith("deterministic error (rule: the same error at the same step")
    assert "no attribute 'param_groups'" in summary.message
    assert r.status == "FAILED" and r.committed_step() == 4  # resumable from the last commit
    (shown,) = r.events("worker_traceback")  # the worker's error, once
    assert "param_groups" in shown["message"]


def test_an_error_seen_once_is_retried_like_a_lost_worker(tmp_path: Path):
    r = make_run(tmp_path, "scaling.min_workers=1")
    r.group.raise_at_step(rank=0, step=6, error="RuntimeError: a transient glitch")
    summary = r.run()
    assert summary.status.value == "FINISHED" and summary.failures == 1


def test_a_worker_failing_while_warming_up_ends_the_run_at_once_with_its_error(tmp_path: Path):
    r = make_run(tmp_path)
    error = "ValueError: data.generated_chars=10 is shorter than one sequence of data.seq_len=32"
    r.group.warmup_raises(error)
    summary = r.run()
    assert summary.status.value == "FAILED" and r.status == "FAILED"
    assert error in summary.message and "resumable once capacity is back" not in summary.message
    assert not r.events("waiting_for_capacity") and not r.events("attempt_started")
    assert len(r.group.warmup_errors) == 2  # the two first workers: no busy loop of restarts


def test_a_finished_run_leaves_its_last_attempt_cleanly_and_removes_its_shm_buffers(tmp_path: Path):
    import socket

    r = make_run(tmp_path)
    last: list = []
    r.controller.callbacks.after_attempt_start.append(lambda c: last.__setitem__(slice(None), c.active))
    # A port of its own: every other fake run on this host (another xdist worker's) cleans 29500's buffers.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = r.group.rendezvous_port = s.getsockname()[1]
    buffer = Path(f"/dev/shm/deepspeed_allreduce_buffer_{tmp_path.name}_127.0.0.1_{port}_0")
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm here")
    buffer.write_bytes(b"x")  # what a rank of this run's rendezvous left
    try:
        assert r.run().status.value == "FINISHED"
        assert last and all(w.calls[-1] == "teardown" for w in last)  # each rank removes its own
        assert not buffer.exists()  # and the driver those on its host that a rank could not
        assert str(buffer) in r.events("shm_buffers_removed")[0]["paths"]
    finally:
        buffer.unlink(missing_ok=True)


def test_nvme_swap_folders_are_keyed_by_run_and_rank(tmp_path: Path):
    from elastictrain.config.deepspeed_config import nvme_paths

    swap = tmp_path / "nvme"
    swap.mkdir()
    r = make_run(
        tmp_path,
        "deepspeed.zero_stage=3",
        "deepspeed.offload_optimizer=nvme",
        f"deepspeed.nvme_path={swap}",
    )
    specs: list = []
    r.controller.callbacks.after_attempt_start.append(lambda c: specs.extend(w.spec for w in c.active))
    r.run()
    run_id = r.run_dir.read_info().run_id
    assert [nvme_paths(s.ds_config) for s in specs[:2]] == [
        [str(swap / run_id / "rank-0")],
        [str(swap / run_id / "rank-1")],
    ]


def test_at_the_first_start_placed_workers_warm_up_while_a_reservation_that_cannot_be_placed_is_awaited(
    tmp_path: Path,
):
    r = make_run(tmp_path, "scaling.min_workers=1", "scaling.max_workers=3", capacity=2)
    workers_when_waiting: list[int] = []
    wait = r.group.wait_for_reservations

    def recording_wait(n: int, timeout_s: float) -> int:
        workers_when_waiting.append(len(r.group.workers))
        return wait(n, timeout_s)

    r.group.wait_for_reservations = recording_wait  # type: ignore[method-assign]
    summary = r.run()
    assert summary.status.value == "FINISHED"
    # A short wait, then the two placed reservations' actors start before the long wait for the third.
    assert workers_when_waiting[:2] == [0, 2]
    assert [e["world_size"] for e in r.events("attempt_started")] == [2]
