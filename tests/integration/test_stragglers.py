"""A rank slowed by an injected forward delay in a 3-worker run is named, with its worker and node, within
failure.straggler_steps steps; its losses stay those of the others (it is slow, not wrong). Real Ray
workers, real DeepSpeed (gloo)."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
from helpers import run, tiny_config

from elastictrain.testing.chaos import at_step

pytestmark = pytest.mark.integration


def test_a_rank_slowed_twice_over_is_named_within_the_configured_steps(
    ray_local: None, tmp_path: Path
) -> None:
    cfg = tiny_config(
        tmp_path / "run",
        "scaling.min_workers=3",
        "scaling.max_workers=3",
        "deepspeed.zero_stage=1",
        "training.max_steps=10",
        "failure.straggler_steps=3",
    )

    def slow_rank_1(controller) -> None:  # noqa: ANN001
        ray.get(controller.active[1].actor.inject_forward_delay.remote(0.05))

    summary, run_dir, output = run(cfg, hook=at_step(1, slow_rank_1))
    assert summary.status.value == "FINISHED", output
    events = run_dir.read_events()
    (named,) = [e for e in events if e["event"] == "straggler"]
    workers = next(e for e in events if e["event"] == "attempt_started")["workers"]
    assert named["rank"] == 1 and named["worker"] == workers[1] and named["node"]
    assert named["ratio"] > 1.3
    # Steps already queued when the delay arrived may run at the old pace: named within 3 more and 2 queued.
    assert named["step"] <= 1 + 3 + 2
    assert "is a straggler" in output
    assert run_dir.read_info().extra["stragglers"][0]["rank"] == 1
