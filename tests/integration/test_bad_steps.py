"""A step whose loss turns NaN on one rank (its logits NaN, as from a bad batch) is not applied by any rank:
the run goes on with finite losses and weights, and the step, its samples and the rank that saw it are
recorded. Real Ray workers, real DeepSpeed engines (gloo)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import ray
import torch
from helpers import run, tiny_config
from test_train_end_to_end import _losses

from elastictrain.checkpoint.zero_state import FragmentReader
from elastictrain.testing.chaos import at_step

pytestmark = pytest.mark.integration

POISONED = 5  # the step index (0-based) whose first micro-batch on rank 0 comes out NaN: step 6


@pytest.mark.parametrize(
    "stage, precision",
    [(0, "fp32"), (2, "bf16")],  # torch's own optimizer (guarded by elastictrain); DeepSpeed's ZeRO and bf16
)
def test_a_non_finite_step_is_skipped_by_every_rank_and_recorded(
    ray_local: None, tmp_path: Path, stage: int, precision: str
) -> None:
    cfg = tiny_config(
        tmp_path / "run",
        f"deepspeed.zero_stage={stage}",
        f"training.precision={precision}",
        "training.max_steps=8",
        "checkpoint.every_steps=4",
    )

    def poison(controller) -> None:  # noqa: ANN001
        ray.get(controller.active[0].actor.inject_fault.remote("nan", POISONED))

    summary, run_dir, output = run(cfg, hook=at_step(2, poison))
    assert summary.status.value == "FINISHED", output
    (bad,) = [e for e in run_dir.read_events() if e["event"] == "bad_step"]
    assert bad["step"] == POISONED + 1
    assert bad["non_finite_loss_ranks"] == [0] and bad["skipped_ranks"] == [0, 1]
    # Each rank's samples of that step are named (3 micro-batches of 2 per rank), and were not retried.
    assert {rank: len(ids) for rank, ids in bad["samples"].items()} == {"0": 6, "1": 6}
    assert run_dir.read_info().skipped_steps == 1
    assert f"step {POISONED + 1} was not applied" in output

    losses = _losses(run_dir)
    assert not math.isfinite(losses[POISONED + 1])  # the step's own loss, as computed
    assert all(math.isfinite(losses[s]) for s in losses if s != POISONED + 1), losses
    assert _losses(run_dir, "skipped_steps")[8] == 1.0
    weights = FragmentReader(sorted((run_dir.path / "checkpoints" / "step-000008").glob("*.safetensors")))
    assert all(torch.isfinite(weights.full(name)).all() for name in weights.params)
