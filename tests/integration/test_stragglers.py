"""A rank slowed by an injected forward delay in a 3-worker run is named, with its worker and node, within
failure.straggler_steps steps, and with failure.replace_stragglers dropped (no warm spare; two ranks are
faster than three with it): the others go on from memory, its node (this machine's only one) is avoided,
so the run stays at two, and the losses are the plain PyTorch loop's at every step. Real Ray workers, real
DeepSpeed (gloo)."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
from helpers import run, tiny_config
from reference import train_reference
from test_train_end_to_end import _losses

from elastictrain.data.sources import dataset_from_config
from elastictrain.testing.chaos import at_step

pytestmark = pytest.mark.integration


def test_a_slowed_rank_is_named_within_the_configured_steps_and_dropped_losing_nothing(
    ray_local: None, tmp_path: Path
) -> None:
    cfg = tiny_config(
        tmp_path / "run",
        "scaling.min_workers=2",
        "scaling.max_workers=3",
        "deepspeed.zero_stage=1",
        "training.max_steps=10",
        "failure.straggler_steps=3",
        "failure.straggler_factor=2.0",  # the delay makes it 3-4x; a loaded machine's noise stays below 2x
        "failure.replace_stragglers=true",
    )

    def slow_rank_1(controller) -> None:  # noqa: ANN001
        ray.get(controller.active[1].actor.inject_forward_delay.remote(0.05))

    summary, run_dir, output = run(cfg, hook=at_step(1, slow_rank_1), faults=True)
    assert summary.status.value == "FINISHED", output
    events = run_dir.read_events()
    named = next(e for e in events if e["event"] == "straggler")
    workers = next(e for e in events if e["event"] == "attempt_started")["workers"]
    assert named["rank"] == 1 and named["worker"] == workers[1] and named["node"]
    assert named["ratio"] > 2.0
    # Steps already queued when the delay arrived may run at the old pace: named within 3 more and 2 queued.
    assert named["step"] <= 1 + 3 + 2
    assert "is a straggler" in output
    assert run_dir.read_info().extra["stragglers"][0]["rank"] == 1
    failure = next(e for e in events if e["event"] == "failure")
    assert failure["kind"] == "straggler" and failure["workers"] == [workers[1]]
    assert "dropped (2 ranks take about" in failure["message"], failure["message"]
    assert f"node {named['node'][:12]} avoided for new workers for 1800s" in failure["message"]
    # No new worker on the avoided node, and this cluster has no other: the run ends at two.
    assert summary.world_sizes[-1] == 2, summary.world_sizes
    assert next(e for e in events if e["event"] == "recovered")["recovered_from"] == "memory"
    # Slow, not wrong: every step's loss is the plain PyTorch loop's, across the swap and the sizes.
    dataset = dataset_from_config(cfg)
    want, _ = train_reference(cfg, dataset, 10)
    split, _ = train_reference(cfg, dataset, 10, micro_batches=6)
    tol = 10 * max(max(abs(a - b) for a, b in zip(want, split, strict=True)), 1.2e-7 * max(want))
    got = _losses(run_dir)
    assert max(abs(got[s + 1] - want[s]) for s in range(10)) <= tol, (got, want)


def test_a_slowed_pipeline_stage_is_named_against_the_same_stage_of_the_other_replica(
    ray_local: None, tmp_path: Path
) -> None:
    """P 2 x D 2: stages differ in their layers, so a rank is compared with its stage in the other replica.
    Rank 2 (the second replica's first stage) slowed is named; nobody else is, though the last stage
    (the head's logits) does more than the first."""
    cfg = tiny_config(
        tmp_path / "run",
        "scaling.min_workers=4",
        "scaling.max_workers=4",
        "deepspeed.zero_stage=1",
        "scaling.pipeline_parallel=2",
        "model.hf_config.tie_word_embeddings=false",
        "training.max_steps=8",
        "failure.straggler_steps=3",
        "failure.straggler_factor=2.0",
    )

    def slow_rank_2(controller) -> None:  # noqa: ANN001
        ray.get(controller.active[2].actor.inject_forward_delay.remote(0.05))

    summary, run_dir, output = run(cfg, hook=at_step(1, slow_rank_2), faults=True)
    assert summary.status.value == "FINISHED", output
    named = [e for e in run_dir.read_events() if e["event"] == "straggler"]
    assert [e["rank"] for e in named] == [2], named
    assert named[0]["ratio"] > 2.0 and named[0]["step"] <= 1 + 3 + 2
    assert summary.world_sizes == [4], summary.world_sizes  # named, kept: failure.replace_stragglers off
