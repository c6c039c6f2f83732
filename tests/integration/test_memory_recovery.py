"""Issue 15: recover from the workers' memory, losing at most the step in flight (real Ray, real DeepSpeed).

One fault-free reference run gives the parameters every other run must end with; every run's sample ledger
is exact. Two runs with a snapshot every step stop a step at a given moment (inside the backward pass,
before the update, before the snapshot's replica is sent) by a crash of the worker's process, then by the
removal of its node: each failure costs at most one step, from memory, and the run grows back. After
that, the crash run loses a rank and its buddy together (nothing holds that rank's slice: the run says so,
loads the disk checkpoint, and MLflow records where each recovery came from), and the node run loses
another node between two steps (its rank's slice comes from its buddy on another node). Those two keep a
snapshot every step (the default interval) whatever a snapshot costs: on a loaded machine the default 3%
rule may space snapshots out, and a step without one has no replica to stop before. A last run keeps the
3% rule on and crashes a worker in the step whose copy is the schedule's first probe (taken at that step's
update, not beside it): one step lost too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ray
from helpers import after_attempt_start, chain, run, tiny_config, wait_until_replacements_are_warm

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
        controller.ledger = lambda step, rank, ids, _skipped=False: records.append((step, rank, list(ids)))

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
    summary, run_dir, out = run(cfg, tracking=False, faults=True)
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


def test_a_crash_at_any_moment_of_a_step_costs_at_most_one_step_and_one_with_its_buddy_falls_back_to_disk(
    ray_cluster, reference, tmp_path
):
    """A snapshot every step (the default interval, held whatever it costs): a worker's process exits
    inside the first micro-batch's backward pass, right before the optimizer update, and before the
    replica of the snapshot beside its step reaches the buddy; after each the run goes on from memory at
    world size 2, grows back to 3 once the replacement is warm, and the next crash comes. Last, a rank and
    its buddy exit together at a step's start: the survivor holds no copy of that rank's slice, so the run
    says why not from memory and goes on from the disk checkpoint at world size 1."""
    records: list[tuple[int, int, list[int]]] = []
    phases = ["backward", "update", "replica"]
    armed: list[tuple[str, int]] = []
    pair: list[int] = []  # the rank and its buddy that crash together, last

    def arm_or_wait(controller: Any) -> None:
        if pair:
            return  # the run ends at the size it has
        if controller.world_size < 3:
            wait_until_replacements_are_warm(controller)  # so that the run grows back before the next
        elif phases:
            at = fault_step(controller.step + 1)
            ray.get(controller.active[2].actor.inject_fault.remote("crash", at, phases[0]))
            armed.append((phases.pop(0), at))
        else:
            # The newcomer must be the survivor: the other two also hold the last world's snapshots of
            # this step, and would recover it from memory. At this attempt's first step: one always runs.
            starts = events(controller.recorder.run_dir, "attempt_started")
            before, buddies = set(starts[-2]["workers"]), starts[-1]["buddies"]
            old = [r for r, w in enumerate(starts[-1]["workers"]) if w in before]
            pair.extend(next((r, buddies[r]) for r in old if buddies[r] in old))
            for r in pair:
                ray.get(controller.active[r].actor.inject_fault.remote("crash", controller.step, "start"))

    summary, run_dir, out = run(
        # A snapshot every step: the replica phase needs one at the armed step. Four failures: one past
        # the default budget.
        config(tmp_path / "run", "failure.max_failures=4"),
        hook=chain(ledger(records), after_attempt_start(arm_or_wait)),
        faults=True,
    )
    assert summary.status.value == "FINISHED", out
    assert [p for p, _ in armed] == ["backward", "update", "replica"], armed
    assert len(pair) == 2, pair
    failures = events(run_dir, "failure")
    assert len(failures) == 4 and all(f["kind"] == "worker_died" for f in failures), failures
    recovered = events(run_dir, "recovered")
    from_memory = [r for r in recovered if r["time"] < failures[3]["time"]]
    # Each crash's shrink and the grows after the first two (the pair crashes in the third's first step).
    assert len(from_memory) == 5, recovered
    assert all(r["recovered_from"] == "memory" for r in from_memory), recovered
    assert all(r["steps_lost"] <= 1 for r in from_memory), recovered
    # Nothing holds the first rank's slice of the pair: why is said in the event and on the terminal.
    decision = events(run_dir, "decision")[-1]
    assert decision["recovered_from"] == "disk", decision
    assert f"not from memory: {decision['memory']}" in decision["message"], decision
    assert "not from memory" in out
    restart = next(e for e in events(run_dir, "attempt_started") if e["time"] > failures[-1]["time"])
    assert (restart["source"], restart["world_size"]) == ("disk", 1), restart
    assert restart["checkpoint"] == f"step-{restart['step']:06d}", restart
    from_disk = next(r for r in recovered if r["time"] > failures[-1]["time"])
    assert from_disk["recovered_from"] == "disk", recovered
    assert from_disk["steps_lost"] == failures[-1]["step"] - restart["step"], (failures, recovered)
    assert_exact_ledger(records, seed=42)
    assert_same_parameters(run_dir, reference)
    # MLflow has where each recovery came from.
    from mlflow import MlflowClient

    from elastictrain.tracking.tracker import resolve_tracking_uri

    info = run_dir.read_info()
    client = MlflowClient(resolve_tracking_uri(info.mlflow_tracking_uri, run_dir.path))
    history = client.get_metric_history(info.mlflow_run_id, "recovered_from_memory")
    assert sorted(m.value for m in history) == sorted(
        float(r["recovered_from"] == "memory") for r in recovered
    )


def test_a_node_removed_at_any_moment_of_a_step_costs_at_most_one_step_with_a_snapshot_every_step(
    ray_cluster, reference, tmp_path
):
    """A snapshot every step (the default interval, held whatever it costs): a worker stops inside the first
    micro-batch's backward pass, right before the optimizer update, and before the replica of the snapshot
    beside its step is sent; its node is removed from the cluster while it is stopped there (a node lost at
    that moment). After each the run goes on from memory at world size 2, the node is added back, the run
    grows back to 3, and the next comes. Last, at world size 2, a node goes between two steps: the run goes
    on from memory at world size 1, its lost rank's slice served by its buddy on the other node."""
    import threading
    import time

    records: list[tuple[int, int, list[int]]] = []
    phases = ["backward", "update", "replica"]
    armed: list[tuple[str, int]] = []
    removed: list[str] = []
    problems: list[BaseException] = []
    between: list[int] = []  # the step after which the last node goes
    lost: list[str] = []  # that node's worker

    def remove_its_node_once_stopped(actor: Any, node_id: str, phase: str) -> None:
        try:
            deadline = time.monotonic() + 60
            progress = actor.progress.options(concurrency_group="control")  # answered while a step hangs
            while ray.get(progress.remote(), timeout=10)["phase"] != "hung":
                assert time.monotonic() < deadline, "the armed worker never stopped"
                time.sleep(0.05)
            if phase == "replica":
                # Long enough for the others to finish the next step and copy it, pushing out the snapshot
                # a recovery needs, were the stopped worker still taking part in that step's collectives
                # (a worker lost there takes part in nothing: FaultyTrainWorker stops it whole).
                time.sleep(3)
            node = next(n for n in ray_cluster.worker_nodes if n.node_id == node_id)
            ray_cluster.remove_node(node)
            removed.append(node_id)
        except BaseException as e:  # noqa: BLE001 - reported by the test's thread
            problems.append(e)

    removals: list[threading.Thread] = []

    def arm_or_grow(controller: Any) -> None:
        if phases and controller.world_size < 3:
            for t in removals:  # the run may go on before remove_node returns: count nodes after it
                t.join(timeout=60)
            if len(ray_cluster.worker_nodes) < 3:
                ray_cluster.add_node(num_cpus=1)
            wait_until_replacements_are_warm(controller)  # so that the run grows back before the next
        elif phases:
            at = fault_step(controller.step + 1)
            victim = controller.active[2]
            ray.get(victim.actor.inject_fault.remote("hang", at, phases[0]))
            armed.append((phases.pop(0), at))
            removals.append(
                threading.Thread(
                    target=remove_its_node_once_stopped,
                    args=(victim.actor, victim.node_id, armed[-1][0]),
                    daemon=True,
                )
            )
            removals[-1].start()
        elif not between:  # two steps in: the attempt's first snapshot is then complete everywhere
            between.append(controller.step + 2)

    def remove_a_node_between_steps(controller: Any, _index: int, _results: Any) -> None:
        if between and controller.step == between[0] and not lost:
            victim = controller.active[1]
            lost.append(victim.worker_id)
            ray_cluster.remove_node(next(n for n in ray_cluster.worker_nodes if n.node_id == victim.node_id))

    def between_steps(controller: Any) -> None:
        controller.callbacks.after_step.append(remove_a_node_between_steps)

    try:
        summary, run_dir, out = run(
            # A snapshot every step: the replica phase needs one at the armed step. Four failures: one
            # past the default budget.
            config(tmp_path / "run", "failure.max_failures=4"),
            hook=chain(ledger(records), after_attempt_start(arm_or_grow), between_steps),
            faults=True,
        )
    finally:
        while len(ray_cluster.worker_nodes) < 3:  # leave the module's cluster as it was
            ray_cluster.add_node(num_cpus=1)
    assert not problems, problems
    assert summary.status.value == "FINISHED", out
    assert [p for p, _ in armed] == ["backward", "update", "replica"], armed
    assert len(removed) == 3 and len(lost) == 1, (removed, lost)
    starts = events(run_dir, "attempt_started")
    assert starts[0]["buddies_off_node"] is True, starts[0]
    history = run_dir.read_info().world_size_history
    # Each removal in a step shrinks to 2, each node added back grows to 3; the one between steps to 1.
    sizes = [(h["world_size"], h["reason"]) for h in history]
    want = [
        (3, "start"),
        (2, "shrink"),
        (3, "grow"),
        (2, "shrink"),
        (3, "grow"),
        (2, "shrink"),
        (1, "shrink"),
    ]
    assert sizes == want, history
    failures = events(run_dir, "failure")
    assert len(failures) == 4 and all(f["kind"] in ("node_lost", "worker_died") for f in failures), failures
    recovered = events(run_dir, "recovered")
    assert len(recovered) == 6, recovered  # 4 shrinks, 2 grows
    assert all(r["recovered_from"] == "memory" for r in recovered), recovered
    assert all(r["steps_lost"] <= 1 for r in recovered), recovered
    # Between steps: the step just reported, or the one before where its copy was still on its way.
    assert (starts[-1]["world_size"], starts[-1]["source"]) == (1, "memory"), starts[-1]
    assert starts[-1]["step"] in (between[0] - 1, between[0]), (between, starts[-1])
    assert recovered[-1]["steps_lost"] == between[0] - starts[-1]["step"], recovered
    # The lost rank's slice came from its buddy, the survivor on the other node.
    decision = events(run_dir, "decision")[-1]
    assert decision["recovered_from"] == "memory" and lost[0] not in decision["memory"], decision
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
        faults=True,
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
