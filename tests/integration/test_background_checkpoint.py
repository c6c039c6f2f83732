"""Checkpoints written in the background: training pauses only for a host-memory snapshot.

A slow disk is simulated on the workers (`inject_write_delay`), so a rank's write outlasts several
training steps. The checkpoint must still hold exactly the state of its step (the snapshot is a copy,
not a view the next steps change), be committed only once every rank's file is in, and a failure
while it is written must fall back to the previous committed checkpoint. The hang after a checkpoint
is also issue 3's hung worker: detected by the hang timeout and replaced by the warm spare.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from helpers import (
    at_step,
    chain,
    offload_overrides,
    record_losses,
    run,
    tiny_config,
    wait_until_replacements_are_warm,
)
from safetensors.torch import load_file

from elastictrain.checkpoint.store import verify

pytestmark = pytest.mark.integration

WRITE_DELAY_S = 4.0  # longer than the steps up to the next checkpoint take on a loaded CI machine
COPY_DELAY_S = 4.0  # several times a step's forward and backward of the tiny model
# The update waits for the slow copy or write only for what the next step's forward and backward have
# not already covered, and those took 2 s with NVMe offload on a loaded 2-core CI machine. A tenth of the
# delay still tells a wait (without one it is a few milliseconds) from none.
WAITED_S = 0.4
# Two checkpoints are enough: one a step follows, and the last. The lost-worker test keeps 12 steps: its
# grow waits for the checkpoint after the restart (step 8), which must not be the last.
STEPS = "training.max_steps=8"
TAGS = ("step-000004", "step-000008")

SyncRun = tuple[list[float], Any]  # a synchronous run's losses and run folder


def slow_disk(controller: Any) -> None:
    ray.get([w.actor.inject_write_delay.remote(WRITE_DELAY_S) for w in controller.active])


def slow_copy(controller: Any) -> None:
    ray.get([w.actor.inject_snapshot_delay.remote(COPY_DELAY_S) for w in controller.active])


def checkpoint_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("rank-*.safetensors")):
        out.update({f"{f.name}/{k}": v for k, v in load_file(f).items()})
    return out


def offload_settings(offload: str, folder: Path) -> list[str]:
    if offload == "none":
        return []
    (folder / "nvme").mkdir(exist_ok=True)
    return offload_overrides(offload, folder / "nvme")


@pytest.fixture(scope="module")
def synchronous_run(ray_local, tmp_path_factory) -> Callable[[str], SyncRun]:
    """The tiny run with synchronous checkpoints (both kept), made once per offload for this module's
    tests: what every background way of writing must equal."""
    runs: dict[str, SyncRun] = {}

    def get(offload: str) -> SyncRun:
        if offload not in runs:
            folder = tmp_path_factory.mktemp(f"sync-{offload}")
            losses: list[float] = []
            overrides = [STEPS, "checkpoint.background_write=false"]
            cfg = tiny_config(folder / "run", *overrides, *offload_settings(offload, folder))
            summary, rd, out = run(cfg, hook=record_losses(losses), tracking=False, faults=True)
            assert summary.status.value == "FINISHED", out
            events = [e for e in rd.read_events() if e["event"] == "checkpoint"]
            assert all(e["committed_at_step"] == e["step"] for e in events), "synchronous: committed at once"
            runs[offload] = (losses, rd)
        return runs[offload]

    return get


def assert_same_as_synchronous(
    sync: SyncRun, losses: list[float], rd: Any, tags: tuple[str, ...] = TAGS
) -> None:
    """The same losses and, tensor for tensor, the same checkpoints as the synchronous run."""
    sync_losses, rd_sync = sync
    assert losses == sync_losses
    for tag in tags:
        a, b = rd.checkpoints_dir / tag, rd_sync.checkpoints_dir / tag
        assert verify(a).ok and verify(b).ok
        ta, tb = checkpoint_tensors(a), checkpoint_tensors(b)
        assert ta.keys() == tb.keys() and ta
        different = [k for k in ta if not torch.equal(ta[k], tb[k])]
        assert not different, f"{tag}: the state differs from the synchronous save: {different[:5]}"


def test_training_goes_on_while_a_checkpoint_is_written_and_it_holds_exactly_its_step(
    tmp_path, synchronous_run
):
    background_losses: list[float] = []
    cfg = tiny_config(tmp_path / "bg", STEPS, "checkpoint.background_write=true")
    summary, rd, out = run(
        cfg, hook=chain(record_losses(background_losses), at_step(1, slow_disk)), tracking=False, faults=True
    )
    assert summary.status.value == "FINISHED", out
    checkpoints = {e["tag"]: e for e in rd.read_events() if e["event"] == "checkpoint"}
    assert list(checkpoints) == list(TAGS), out
    first = checkpoints["step-000004"]
    # Steps after the snapshot ran while the files were written; the commit came later.
    assert first["committed_at_step"] > 4, first
    assert first["seconds"] >= WRITE_DELAY_S, first
    # The pause is measured on the workers (idle before the snapshot, the snapshot, idle after): the
    # write is not part of it.
    pauses = {e["tag"]: e["pause_s"] for e in rd.read_events() if e["event"] == "checkpoint_pause"}
    assert set(pauses) == {"step-000004"}, "every checkpoint a step follows"
    assert pauses["step-000004"] < first["seconds"], (pauses, first)
    assert checkpoints["step-000008"]["committed_at_step"] == 8, "the last one is committed before the end"
    assert_same_as_synchronous(synchronous_run("none"), background_losses, rd)


def test_without_in_memory_snapshots_the_checkpoint_copy_runs_beside_the_next_step_and_holds_its_step(
    tmp_path, synchronous_run
):
    """The state is copied beside the next step's forward and backward, whose update waits for it: a copy
    made slower than them still holds exactly the checkpoint's step, and its wait counts as pause."""
    cfg = tiny_config(tmp_path / "bg", STEPS, "checkpoint.memory_every_steps=0")
    losses: list[float] = []
    summary, rd, out = run(
        cfg, hook=chain(record_losses(losses), at_step(1, slow_copy)), tracking=False, faults=True
    )
    assert summary.status.value == "FINISHED", out
    pauses = {e["tag"]: e["pause_s"] for e in rd.read_events() if e["event"] == "checkpoint_pause"}
    assert set(pauses) == {"step-000004"}, out
    assert min(pauses.values()) >= WAITED_S, pauses  # the update waited for the slow copy
    assert_same_as_synchronous(synchronous_run("none"), losses, rd)


@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_a_checkpoint_too_large_to_copy_is_streamed_beside_the_next_step_and_holds_its_step(
    tmp_path, synchronous_run, offload
):
    """No room for a copy (checkpoint.max_host_memory_mb far below a rank's state): each rank streams its
    file from the live state (with NVMe offload: from the optimizer's swap files) beside the next step's
    forward and backward, whose update waits for the write. A write made slower than them still holds
    exactly the checkpoint's step; its wait is pause."""
    cfg = tiny_config(
        tmp_path / "bg",
        STEPS,
        "checkpoint.memory_every_steps=0",
        "checkpoint.max_host_memory_mb=0.1",  # a rank's state is ~0.7 MB (several MB with NVMe's model)
        *offload_settings(offload, tmp_path),
    )
    losses: list[float] = []
    summary, rd, out = run(
        cfg, hook=chain(record_losses(losses), at_step(1, slow_disk)), tracking=False, faults=True
    )
    assert summary.status.value == "FINISHED", out
    events = rd.read_events()
    checkpoints = [e for e in events if e["event"] == "checkpoint"]
    streamed = [e for e in checkpoints if "streamed from the live state" in e["message"]]
    assert [e["tag"] for e in streamed] == list(TAGS), out
    # Each beside the next step, but the last step's, which has none.
    assert ["beside the next step" in e["message"] for e in streamed] == [True, False], out
    assert "after the last step" in streamed[-1]["message"], out
    pauses = {e["tag"]: e["pause_s"] for e in events if e["event"] == "checkpoint_pause"}
    assert set(pauses) == {"step-000004"}, out
    assert min(pauses.values()) >= WAITED_S, pauses  # the update waited for the slow write
    assert_same_as_synchronous(synchronous_run(offload), losses, rd)


def test_a_worker_lost_while_the_checkpoint_is_written_drops_it_and_restarts_from_the_previous_one(
    ray_local, tmp_path
):
    # Disk recovery only: with in-memory snapshots the survivor would restart from memory at step 5.
    cfg = tiny_config(
        tmp_path / "run", "scaling.min_workers=1", "scaling.max_workers=2", "checkpoint.memory_every_steps=0"
    )

    def kill_last(controller: Any) -> None:  # step-000004's files are still being written
        assert controller.saves.pending is not None and controller.saves.pending.step == 4
        ray.kill(controller.active[-1].actor)

    # The replacement warms up in the background and joins by a grow once warm (after step 7 of the
    # second attempt), so no cold start sits on the recovery path.
    hook = chain(at_step(1, slow_disk), at_step(5, kill_last), at_step(7, wait_until_replacements_are_warm))
    summary, rd, out = run(cfg, hook=hook, tracking=False, faults=True)
    assert summary.status.value == "FINISHED", out
    events = rd.read_events()
    first, second, third = [e for e in events if e["event"] == "attempt_started"]
    # The warm survivor restarts at once (world size 1): the same actor, not a new one.
    assert [first["world_size"], second["world_size"], third["world_size"]] == [2, 1, 2], out
    assert second["actors"] == first["actors"][:1], out
    assert third["actors"][0] == first["actors"][0] and third["actors"][1] not in first["actors"]
    assert [h["reason"] for h in rd.read_info().world_size_history] == ["start", "shrink", "grow"]
    # Each attempt says how much memory its set-up had a rank hold at most (the runtime alone is ~1 GB).
    assert all(a["setup_peak_rss_bytes"] > 200 << 20 for a in (first, second, third)), out
    assert out.count("GiB resident on a rank") >= 3, out
    assert next(e for e in events if e["event"] == "failure")["kind"] == "worker_died"
    assert not [e for e in events if e["event"] == "worker_replaced"]
    abandoned = [e for e in events if e["event"] == "checkpoint_abandoned"]
    assert len(abandoned) == 1 and abandoned[0]["step"] == 4, out
    assert abandoned[0]["written"] < abandoned[0]["ranks"] == 2
    decision = next(e for e in events if e["event"] == "decision")
    assert "restart from the beginning (step 0;" in decision["message"], decision
    recovered = next(e for e in events if e["event"] == "recovered")
    assert recovered["steps_lost"] >= 5
    committed = [e["tag"] for e in events if e["event"] == "checkpoint"]
    assert committed[-1] == "step-000012" and "step-000004" in committed, "saved again after the restart"
    assert not [p for p in rd.checkpoints_dir.iterdir() if p.name.startswith(".")], "no staging left behind"
    assert rd.read_info().last_step == 12


def test_a_checkpoint_whose_writes_end_in_a_hung_step_is_committed_and_a_warm_spare_replaces_the_hung_worker(
    ray_local, tmp_path
):
    # A write that ends is noticed by its own call (a watch), not by the next step's report: here that
    # report never comes (rank 1 hangs in step 4), yet step-000004 is committed and the restart loads it.
    # Told only by step reports, the driver would drop it at the hang (rank 1's file unreported).
    # At min_workers (2 of 2) the run cannot shrink: the spare, warming since the start, takes the hung
    # worker's place (waited for if still warming, so the check needs no fast machine).
    cfg = tiny_config(
        tmp_path / "run",
        STEPS,
        "scaling.spare_workers=1",
        "checkpoint.memory_every_steps=0",  # disk recovery only
        "failure.hang_timeout_s=10",  # the hang is noticed after it; a tiny step takes far less
    )

    def hang_rank_1_in_step_4(controller: Any) -> None:
        ray.get(controller.active[1].actor.inject_fault.remote("hang", 4))

    summary, rd, out = run(cfg, hook=at_step(1, hang_rank_1_in_step_4), tracking=False, faults=True)
    assert summary.status.value == "FINISHED", out
    events = rd.read_events()
    failure = next(e for e in events if e["event"] == "failure")
    assert failure["kind"] == "hang" and failure["step"] == 4, failure
    assert "for 10s (failure.hang_timeout_s)" in failure["message"], failure
    # Only the hung worker is blamed: its peer was waiting inside a collective.
    assert len(failure["workers"]) == 1, failure
    assert "_maybe_fault" in failure["message"], failure  # where it was stuck, from its live stack
    first_save = next(e for e in events if e["event"] == "checkpoint")
    assert first_save["tag"] == "step-000004" and first_save["committed_at_step"] == 4, first_save
    assert events.index(first_save) < events.index(failure), "committed while step 4 hung"
    assert not [e for e in events if e["event"] == "checkpoint_abandoned"], out
    decision = next(e for e in events if e["event"] == "decision")
    assert "step-000004" in decision["message"], decision
    first, second = [e for e in events if e["event"] == "attempt_started"]
    assert second["checkpoint"] == "step-000004", second
    assert second["actors"][0] == first["actors"][0] and second["actors"][1] != first["actors"][1], out
    # Three actors from the start (before the first attempt): the two warm first are the ranks, the
    # third the spare.
    started = [
        w for e in events[: events.index(first)] if e["event"] == "workers_starting" for w in e["workers"]
    ]
    (spare,) = set(started) - set(first["workers"])
    assert len(started) == 3 and second["world_size"] == 2, out
    assert second["workers"][1] == spare, out
    assert not [e for e in events if e["event"] == "waiting_for_capacity"], out
    assert rd.read_info().last_step == 8
