"""Issue 58 point 5: a DPO full fine-tune is elastic as supervised fine-tuning is.

On a cluster of 3 one-CPU nodes, one fault-free run at 2 workers gives the losses. The same run then
loses a worker in its reference pass (its process crashes at the chunk at item 32: chunks 0-15 and 16-31
are written), goes on at 1 worker from the chunks written, grows back to 2, loses a node in training
(removed after step 3: recovered from memory, its buddy on the other node), grows back once the node is
added again: every step's loss equals the fault-free run's within float noise, the reference pass
computes only the chunks not yet written, and a resume past the end reads the table, computing nothing.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import ray
from helpers import (
    after_attempt_start,
    at_step,
    chain,
    quiet_reporter,
    run,
    tiny_config,
    wait_until_replacements_are_warm,
)

from elastictrain.core.losses import replica_results, step_loss

pytestmark = pytest.mark.integration

CHUNK = 16  # 64 pairs: 4 chunks


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from preference_fixtures import write_pairs
    from sft_fixtures import make_chatml_tokenizer

    root = tmp_path_factory.mktemp("dpo")
    return make_chatml_tokenizer(root / "tokenizer"), write_pairs(root / "data", 64)


def dpo_config(run_dir: Path, data: tuple[Path, Path], *extra: str) -> Any:
    tokenizer, folder = data
    return tiny_config(
        run_dir,
        "data.source=sft",
        f"data.dataset_dir={folder}",
        "data.dataset=pairs",
        f"data.tokenizer={tokenizer}",
        "data.seq_len=64",
        "training.objective=dpo",
        "training.global_batch_size=8",
        "training.micro_batch_size=4",
        "training.max_steps=8",
        "training.warmup_steps=1",
        "training.lr=1e-2",
        "checkpoint.every_steps=4",
        *extra,
    )


def losses_by_step(found: dict[int, float]) -> Any:
    """A hook keeping each step's loss over the global batch (a redone step: its last report)."""

    def hook(controller: Any) -> None:
        def after_step(c: Any, _index: int, results: list[dict[str, Any]]) -> None:
            found[c.step] = step_loss(replica_results(results))

        controller.callbacks.after_step.append(after_step)

    return hook


def small_chunks(controller: Any) -> None:
    controller.reference.chunk_items = CHUNK


def test_a_dpo_run_that_loses_a_worker_in_its_reference_pass_and_a_node_in_training_trains_the_same_losses(
    ray_cluster, tmp_path, data
):
    fault_free: dict[int, float] = {}
    cfg = dpo_config(tmp_path / "fault-free", data, "scaling.min_workers=2", "scaling.max_workers=2")
    summary, _, out = run(
        cfg, hook=chain(small_chunks, losses_by_step(fault_free)), tracking=False, faults=True
    )
    assert summary.status.value == "FINISHED", out
    assert fault_free[1] == pytest.approx(math.log(2), abs=1e-6), "DPO starts at ln 2"

    attempts: list[int] = []

    def crash_in_reference_pass(controller: Any) -> None:
        attempts.append(controller.attempt)
        small_chunks(controller)
        if len(attempts) == 1:
            ray.get(controller.active[1].actor.inject_fault.remote("crash", 2 * CHUNK, "reference"))

    def remove_last_node(controller: Any) -> None:
        victim = controller.active[-1]
        ray_cluster.remove_node(next(n for n in ray_cluster.worker_nodes if n.node_id == victim.node_id))

    def add_node_back(controller: Any) -> None:
        ray_cluster.add_node(num_cpus=1)
        wait_until_replacements_are_warm(controller)

    found: dict[int, float] = {}
    hook = chain(
        after_attempt_start(crash_in_reference_pass),
        losses_by_step(found),
        at_step(1, wait_until_replacements_are_warm),  # the first grow, back to 2
        at_step(3, remove_last_node),
        at_step(5, add_node_back),  # and the second
    )
    cfg = dpo_config(tmp_path / "elastic", data, "scaling.min_workers=1", "scaling.max_workers=2")
    try:
        summary, rd, out = run(cfg, hook=hook, tracking=False, faults=True)
    finally:
        while len(ray_cluster.worker_nodes) < 3:  # leave the module's cluster as it was
            ray_cluster.add_node(num_cpus=1)
    assert summary.status.value == "FINISHED", out
    events = rd.read_events()
    passes = [e for e in events if e["event"] == "reference_pass"]
    assert [(p["chunks_done"], p["chunks_todo"]) for p in passes] == [(0, 4), (2, 2)], out
    assert len([e for e in events if e["event"] == "reference_done"]) == 1
    failures = [e for e in events if e["event"] == "failure"]
    assert len(failures) == 2, out
    recovered = [e for e in events if e["event"] == "recovered"]
    assert recovered[-1]["recovered_from"] == "memory", recovered
    sizes = [e["world_size"] for e in events if e["event"] == "attempt_started"]
    assert 1 in sizes and sizes[-1] == 2 and len(sizes) >= 4, sizes
    assert sorted(found) == sorted(fault_free) == list(range(1, 9))
    worst = max(abs(found[s] - fault_free[s]) for s in found)
    assert worst <= 1e-5, f"losses differ by {worst}:\n  {found}\n  {fault_free}"

    # Resumed past its end (as `elastictrain resume RUN training.max_steps=10`), the run reads its table
    # again (checked against its sha256): no pass.
    from elastictrain.config import load_config
    from elastictrain.driver.launch import apply_resume_changes, run_training

    more = load_config(rd.config_yaml, ["training.max_steps=10"])
    apply_resume_changes(rd, more)
    summary = run_training(more, rd, tracking=False, reporter=quiet_reporter(10))
    assert summary.status.value == "FINISHED" and summary.step == 10
    assert len([e for e in rd.read_events() if e["event"] == "reference_pass"]) == 2, out
