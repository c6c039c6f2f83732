"""Issue 15: recover from the workers' memory, losing at most the step in flight (real Ray, real DeepSpeed).

Two elastic runs on a 3-node Ray cluster and one fault-free reference run, shared by the assertions:
  A: a worker is killed at a step that is not a checkpoint step (shrink 3 -> 2 from memory), its
     replacement joins by a grow (from memory), then a whole node is removed (its rank's slice comes
     from that rank's buddy on another node);
  B: a rank and its buddy are killed together (nothing holds that rank's slice: disk), the replacements
     join, then a rank is killed while its in-memory copy is in progress (the previous complete one
     is used).
Both end with the parameters of the fault-free run, and their sample ledgers are exact. Two more runs with
a snapshot every step stop a step at a given moment (inside the backward pass, before the update, before the
snapshot's replica is sent) by a crash of the worker's process, then by the removal of its node: each
failure costs at most one step. Those two keep a snapshot every step (the default interval) whatever a
snapshot costs: on a loaded machine the default 3% rule may space snapshots out, and a step without one
has no replica to stop before. A last run keeps the 3% rule on and crashes a worker in the step whose
copy is the schedule's first probe (taken at that step's update, not beside it): one step lost too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ray
from helpers import after_attempt_start, at_step, chain, run, tiny_config, wait_until_replacements_are_warm

from elastictrain.checkpoint.zero_state import FragmentReader
from elastictrain.core.batch import plan_batch
from elastictrain.core.data_order import micro_batch_samples

pytestmark = pytest.mark.integration

STEPS, GLOBAL_BATCH, EVERY = 12, 12, 4
NUM_SAMPLES = 120000 // 64  # tiny_config's generated data, in seq_len samples


def config(path: Path, *overrides: str):  # noqa: ANN201
    return tiny_config(
        path,
        "scaling.min_workers=1",
        "scaling.max_workers=3",
        f"training.max_steps={STEPS}",
        f"checkpoint.every_steps={EVERY}",
        # A snapshot every step whatever it costs on this machine: the losses asserted below assume it.
        "checkpoint.memory_max_step_share=0",
        *overrides,
    )


def ledger(records: list[tuple[int, int, list[int]]]) -> Callable[[Any], None]:
    def hook(controller: Any) -> None:
        controller.ledger = lambda step, rank, ids: records.append((step, rank, list(ids)))

    return hook


def assert_exact_ledger(records: list[tuple[int, int, list[int]]], seed: int) -> None:
    """Every sample once, and exactly those the global data order gives each step at its world size."""
    final: dict[tuple[int, int], list[int]] = {}
    sizes: dict[int, int] = {}
    for step, rank, ids in records:
        if rank == 0:  # a step redone after a failure replaces what was recorded for it
            for key in [k for k in final if k[0] == step]:
                del final[key]
        final[(step, rank)] = ids
        sizes[step] = max(sizes.get(step, 0), rank + 1) if rank else 1
    consumed = [i for ids in final.values() for i in ids]
    assert len(consumed) == len(set(consumed)) == STEPS * GLOBAL_BATCH
    for step in range(STEPS):
        plan = plan_batch(GLOBAL_BATCH, 2, sizes[step])
        got = sorted(i for (s, _), ids in final.items() if s == step for i in ids)
        want = sorted(
            i
            for r in range(sizes[step])
            for k in range(plan.grad_accum_steps)
            for i in micro_batch_samples(step, plan, r, k, num_samples=NUM_SAMPLES, seed=seed)
        )
        assert got == want, step


def final_state(run_dir: Any) -> FragmentReader:
    return FragmentReader(sorted((run_dir.checkpoints_dir / f"step-{STEPS:06d}").glob("*.safetensors")))


def assert_same_parameters(elastic: Any, reference: Any) -> None:
    # Same global batch and data order: only the order of floating-point sums differs between world
    # sizes (~1e-7 relative per step); 1e-4 of each tensor's norm is far below what 12 steps change.
    a, b = final_state(elastic), final_state(reference)
    for name in b.params:
        x, y = a.full(name), b.full(name)
        assert float((x - y).norm() / y.norm()) < 1e-4, name


@pytest.fixture(scope="module")
def reference(ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A fault-free run at a fixed world size (2), snapshots off: the parameters the others must reach."""
    cfg = config(
        tmp_path_factory.mktemp("reference") / "run",
        "scaling.min_workers=2",
        "scaling.max_workers=2",
        "checkpoint.memory_every_steps=0",
    )
    summary, run_dir, out = run(cfg, tracking=False)
    assert summary.status.value == "FINISHED", out
    return run_dir


def fault_step(step: int) -> int:
    """The first step from `step` to arm an "any moment" fault at. Not step 1: its snapshot's replica may
    still be on its way when the fault comes, and no snapshot of the initial state exists to fall back
    to (the run restarts from step 0: one step lost, not from memory). Not a checkpoint step: the disk
    checkpoint of that step is then newer than the snapshot before it, and the run rightly loads it."""
    step = max(step, 2)
    return step + 1 if step % EVERY == 0 else step


def events(run_dir: Any, name: str) -> list[dict[str, Any]]:
    return [e for e in run_dir.read_events() if e["event"] == name]


def survivors_replaced(run_dir: Any, failure: dict[str, Any]) -> int:
    """How many survivors of this failure were replaced for not leaving its attempt in time."""
    after = [
        e for e in run_dir.read_events() if e["event"] == "worker_replaced" and e["time"] >= failure["time"]
    ]
    decision = next(e for e in events(run_dir, "decision") if e["time"] >= failure["time"])
    return len([e for e in after if e["time"] <= decision["time"]])


def survivors_all_replaced(run_dir: Any, failure: dict[str, Any], survivors: int) -> bool:
    return survivors_replaced(run_dir, failure) >= survivors


def test_killed_worker_and_lost_node_recover_from_memory_losing_at_most_one_step(
    ray_cluster, reference, tmp_path
):
    records: list[tuple[int, int, list[int]]] = []
    lost_node: list[str] = []

    def kill_a_worker(controller: Any) -> None:
        ray.kill(controller.active[2].actor)

    def remove_a_node(controller: Any) -> None:
        node_id = controller.active[1].node_id
        lost_node.append(controller.active[1].worker_id)
        ray_cluster.remove_node(next(n for n in ray_cluster.worker_nodes if n.node_id == node_id))

    hook = chain(
        ledger(records),
        at_step(5, kill_a_worker),  # checkpoints are at 4, 8, 12: step 5 is not one
        at_step(6, wait_until_replacements_are_warm),  # so the replacement joins by a grow at step 7 or 8
        at_step(10, remove_a_node),
    )
    try:
        summary, run_dir, out = run(config(tmp_path / "run"), hook=hook)
    finally:
        ray_cluster.add_node(num_cpus=1)  # leave the module's cluster as it was
    assert summary.status.value == "FINISHED", out
    starts = events(run_dir, "attempt_started")
    shrink, grow = [(s["world_size"], s["source"], s["step"]) for s in starts][1:3]
    # Killed right after step 5 was reported: its copy of step 5 may still have been on its way to
    # the buddy, and then step 4 (complete everywhere) is loaded; at most the step in flight is lost.
    assert shrink in ((2, "memory", 5), (2, "memory", 4)), out
    # Grown from memory once the replacement is warm (after step 7): at step 7 or 8, whether step 8's
    # checkpoint was already queued ("just checkpointed") or not (every rank's copy of the step).
    assert grow[:2] == (3, "memory") and grow[2] in (7, 8), out
    assert starts[0]["buddies_off_node"] is True
    recovered = events(run_dir, "recovered")
    assert recovered[0]["recovered_from"] == "memory" and recovered[0]["steps_lost"] == 5 - shrink[2]
    assert (recovered[1]["recovered_from"], recovered[1]["steps_lost"]) == ("memory", 0), recovered
    failures = events(run_dir, "failure")
    assert failures[1]["kind"] in ("node_lost", "worker_died")  # a raylet's death can be seen either way
    node_decision = events(run_dir, "decision")[1]
    replaced = survivors_replaced(run_dir, failures[1])
    if replaced >= 2:
        # The gloo limit (README): both survivors stayed blocked past the teardown timeout and were
        # replaced, taking their snapshots along; said, and the disk checkpoint is used.
        assert node_decision["recovered_from"] == "disk" and "no survivor holds" in node_decision["memory"]
    else:
        # The node went right after step 10 was reported: its rank's copy of step 10 may still have been
        # on its way to the buddy, and then step 9 (complete everywhere) is loaded; one step lost at most.
        # A survivor replaced for being stuck (one of two) first handed its snapshots to the other, whose
        # slot is then the only one ready: the run goes on at world size 1, still from memory.
        assert (starts[3]["world_size"], starts[3]["source"]) == (2 - replaced, "memory"), starts[3]
        assert starts[3]["step"] in (9, 10)
        assert recovered[2]["recovered_from"] == "memory" and recovered[2]["steps_lost"] <= 1
        # The lost node's rank had its slice served by its buddy, another worker on another node.
        assert node_decision["recovered_from"] == "memory"
        assert lost_node[0] not in node_decision["memory"]
    assert_exact_ledger(records, seed=42)
    assert_same_parameters(run_dir, reference)


def test_rank_and_buddy_lost_falls_back_to_disk_and_a_copy_in_flight_uses_the_previous_one(
    ray_cluster, reference, tmp_path
):
    records: list[tuple[int, int, list[int]]] = []

    def kill_rank_1_and_its_buddy(controller: Any) -> None:
        buddy = events(controller.recorder.run_dir, "attempt_started")[-1]["buddies"][1]
        ray.kill(controller.active[1].actor)
        ray.kill(controller.active[buddy].actor)

    def slow_copies_on_rank_1(controller: Any) -> None:
        if controller.attempt == 3:  # every copy of rank 1 now takes 2 s more
            ray.get(controller.active[1].actor.inject_snapshot_delay.remote(2.0))

    def kill_rank_1_mid_copy(controller: Any) -> None:
        ray.kill(controller.active[1].actor)  # its copy of step 10 has just started

    hook = chain(
        ledger(records),
        at_step(6, kill_rank_1_and_its_buddy),
        at_step(7, wait_until_replacements_are_warm),
        after_attempt_start(slow_copies_on_rank_1),
        at_step(10, kill_rank_1_mid_copy),
    )
    summary, run_dir, out = run(config(tmp_path / "run"), hook=hook, tracking=True)
    assert summary.status.value == "FINISHED", out
    decisions = events(run_dir, "decision")
    assert decisions[0]["recovered_from"] == "disk"
    assert "rank(s) [1]" in decisions[0]["memory"] and "not from memory" in decisions[0]["message"]
    assert "not from memory" in out  # said in the terminal too
    starts = events(run_dir, "attempt_started")
    assert (starts[1]["source"], starts[1]["checkpoint"], starts[1]["world_size"]) == (
        "disk",
        "step-000004",
        1,
    )
    recovered = events(run_dir, "recovered")
    assert (recovered[0]["recovered_from"], recovered[0]["steps_lost"]) == ("disk", 2)
    mid_copy = events(run_dir, "failure")[-1]
    memory_used = not survivors_all_replaced(run_dir, mid_copy, survivors=2)
    if memory_used:
        # Rank 1's copy of step 10 was in progress: step 9, complete everywhere, is what the restart loads.
        assert (starts[-1]["source"], starts[-1]["step"]) == ("memory", 9), out
        assert (recovered[-1]["recovered_from"], recovered[-1]["steps_lost"]) == ("memory", 1)
    else:  # the gloo limit (README): both survivors replaced with what they held; said, disk is used
        assert events(run_dir, "decision")[-1]["recovered_from"] == "disk"
    assert_exact_ledger(records, seed=42)
    assert_same_parameters(run_dir, reference)
    # MLflow has where each recovery came from.
    from mlflow import MlflowClient

    from elastictrain.tracking.tracker import resolve_tracking_uri

    info = run_dir.read_info()
    client = MlflowClient(resolve_tracking_uri(info.mlflow_tracking_uri, run_dir.path))
    history = client.get_metric_history(info.mlflow_run_id, "recovered_from_memory")
    assert sorted(m.value for m in history) == [0.0, 1.0, 1.0 if memory_used else 0.0]


def test_a_worker_crashing_at_any_moment_of_a_step_costs_at_most_one_step_with_a_snapshot_every_step(
    ray_cluster, reference, tmp_path
):
    """A snapshot every step (the default interval, held whatever it costs): a worker's process exits
    inside the first micro-batch's backward pass, right before the optimizer update, and before the
    replica of the snapshot beside its step reaches the buddy; after each the run goes on from memory at
    world size 2, grows back to 3 once the replacement is warm, and the next crash comes."""
    records: list[tuple[int, int, list[int]]] = []
    phases = ["backward", "update", "replica"]
    armed: list[tuple[str, int]] = []

    def arm_or_wait(controller: Any) -> None:
        if controller.world_size < 3:
            wait_until_replacements_are_warm(controller)  # so that the run grows back before the next
        elif phases:
            at = fault_step(controller.step + 1)
            ray.get(controller.active[2].actor.inject_fault.remote("crash", at, phases[0]))
            armed.append((phases.pop(0), at))

    summary, run_dir, out = run(
        config(tmp_path / "run"),  # a snapshot every step: the replica phase needs one at the armed step
        hook=chain(ledger(records), after_attempt_start(arm_or_wait)),
    )
    assert summary.status.value == "FINISHED", out
    assert [p for p, _ in armed] == ["backward", "update", "replica"], armed
    failures = events(run_dir, "failure")
    assert len(failures) == 3 and all(f["kind"] == "worker_died" for f in failures), failures
    recovered = events(run_dir, "recovered")
    assert len(recovered) >= 3, recovered  # each crash's shrink (and the grows after them)
    assert all(r["recovered_from"] == "memory" for r in recovered), recovered
    assert all(r["steps_lost"] <= 1 for r in recovered), recovered
    assert_exact_ledger(records, seed=42)
    assert_same_parameters(run_dir, reference)


def test_a_node_removed_at_any_moment_of_a_step_costs_at_most_one_step_with_a_snapshot_every_step(
    ray_cluster, reference, tmp_path
):
    """A snapshot every step (the default interval, held whatever it costs): a worker stops inside the first
    micro-batch's backward pass, right before the optimizer update, and before the replica of the snapshot
    beside its step is sent; its node is removed from the cluster while it is stopped there (a node lost at
    that moment). After each the run goes on from memory at world size 2, the node is added back, the run
    grows back to 3, and the next comes."""
    import threading
    import time

    records: list[tuple[int, int, list[int]]] = []
    phases = ["backward", "update", "replica"]
    armed: list[tuple[str, int]] = []
    removed: list[str] = []
    problems: list[BaseException] = []

    def remove_its_node_once_stopped(actor: Any, node_id: str) -> None:
        try:
            deadline = time.monotonic() + 60
            progress = actor.progress.options(concurrency_group="control")  # answered while a step hangs
            while ray.get(progress.remote(), timeout=10)["phase"] != "hung":
                assert time.monotonic() < deadline, "the armed worker never stopped"
                time.sleep(0.05)
            node = next(n for n in ray_cluster.worker_nodes if n.node_id == node_id)
            ray_cluster.remove_node(node)
            removed.append(node_id)
        except BaseException as e:  # noqa: BLE001 - reported by the test's thread
            problems.append(e)

    def arm_or_grow(controller: Any) -> None:
        if controller.world_size < 3:
            if len(ray_cluster.worker_nodes) < 3:
                ray_cluster.add_node(num_cpus=1)
            wait_until_replacements_are_warm(controller)  # so that the run grows back before the next
        elif phases:
            at = fault_step(controller.step + 1)
            victim = controller.active[2]
            ray.get(victim.actor.inject_fault.remote("hang", at, phases[0]))
            armed.append((phases.pop(0), at))
            threading.Thread(
                target=remove_its_node_once_stopped, args=(victim.actor, victim.node_id), daemon=True
            ).start()

    summary, run_dir, out = run(
        config(tmp_path / "run"),  # a snapshot every step: the replica phase needs one at the armed step
        hook=chain(ledger(records), after_attempt_start(arm_or_grow)),
    )
    assert not problems, problems
    assert summary.status.value == "FINISHED", out
    assert [p for p, _ in armed] == ["backward", "update", "replica"], armed
    assert len(removed) == 3, removed
    history = run_dir.read_info().world_size_history
    # Each removal shrinks to 2; each node added back grows to 3 (the last may come after the last step).
    sizes = [(h["world_size"], h["reason"]) for h in history]
    want = [(3, "start"), (2, "shrink"), (3, "grow"), (2, "shrink"), (3, "grow"), (2, "shrink")]
    assert sizes[:6] == want, history
    failures = events(run_dir, "failure")
    assert len(failures) == 3 and all(f["kind"] in ("node_lost", "worker_died") for f in failures), failures
    recovered = events(run_dir, "recovered")
    assert len(recovered) >= 3, recovered
    assert all(r["recovered_from"] == "memory" for r in recovered), recovered
    assert all(r["steps_lost"] <= 1 for r in recovered), recovered
    assert_exact_ledger(records, seed=42)
    assert_same_parameters(run_dir, reference)


def test_a_worker_crashing_in_a_probe_steps_backward_costs_at_most_one_step_at_default_settings(
    ray_cluster, reference, tmp_path
):
    """With the 3% rule on (the default), one marked step in 10 on CPU workers is a probe: its copy is
    taken at the next step's optimizer update instead of beside that step's forward and backward. A
    worker's process exits inside that step's backward pass, before the copy began: the run goes on from
    memory at the step before, one step lost, as when the copy runs beside the step."""
    records: list[tuple[int, int, list[int]]] = []
    probes: list[int] = []

    def crash_in_the_first_probes_step(controller: Any) -> None:
        schedule = controller.pipeline.snapshots
        asked = schedule.probe

        def probe(steps_done: int) -> bool:
            if asked(steps_done) and not probes:
                probes.append(steps_done)  # its copy waits for the update of step index `steps_done`
                ray.get(controller.active[2].actor.inject_fault.remote("crash", steps_done, "backward"))
            return asked(steps_done)

        schedule.probe = probe

    summary, run_dir, out = run(
        config(tmp_path / "run", "checkpoint.memory_max_step_share=0.03"),
        hook=chain(ledger(records), crash_in_the_first_probes_step),
    )
    assert summary.status.value == "FINISHED", out
    # Checkpoint steps (4, 8) are not probes: the 5th other marked step of the attempt is.
    assert probes == [6], probes
    failures = events(run_dir, "failure")
    assert [(f["kind"], f["step"]) for f in failures] == [("worker_died", 6)], failures
    recovered = events(run_dir, "recovered")
    assert (recovered[0]["recovered_from"], recovered[0]["steps_lost"]) == ("memory", 1), recovered
    starts = events(run_dir, "attempt_started")
    assert (starts[1]["world_size"], starts[1]["source"], starts[1]["step"]) == (2, "memory", 5), starts[1]
    assert_exact_ledger(records, seed=42)
    assert_same_parameters(run_dir, reference)
