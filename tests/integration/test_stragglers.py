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
