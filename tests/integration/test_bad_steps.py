"""A step whose loss turns NaN on one rank (its logits NaN, as from a bad batch) is not applied by any rank:
the run goes on with finite losses and weights, and the step, its samples and the rank that saw it are
recorded. Real Ray workers, real DeepSpeed engines (gloo)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import ray
import torch
from helpers import run, tiny_config
from reference import train_reference
from test_train_end_to_end import _losses

from elastictrain.checkpoint.zero_state import FragmentReader
from elastictrain.data.sources import dataset_from_config
from elastictrain.testing.chaos import at_step

pytestmark = pytest.mark.integration

POISONED = 5  # the step index (0-based) whose first micro-batch on rank 0 comes out NaN: step 6


@pytest.mark.parametrize(
    "stage, precision, offload, lora",
    [
        (0, "fp32", "none", False),  # torch's own optimizer, guarded by elastictrain
        (1, "fp32", "none", False),  # DeepSpeed's ZeRO-1/2 optimizer through its gradient norm
        (3, "fp32", "none", False),  # DeepSpeed's ZeRO-3 optimizer
        (2, "bf16", "none", False),  # DeepSpeed's ZeRO-1/2 optimizer through its bf16 overflow check
        (3, "bf16", "cpu", False),  # ZeRO-3 with DeepSpeed's CPU Adam
        (2, "fp32", "none", True),  # LoRA: only the adapters train
    ],
)
def test_a_non_finite_step_is_skipped_by_every_rank_and_recorded(
    ray_local: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    stage: int,
    precision: str,
    offload: str,
    lora: bool,
) -> None:
    ledger = tmp_path / "ledger.jsonl"
    monkeypatch.setenv("ELASTICTRAIN_SAMPLE_LEDGER", str(ledger))
    cfg = tiny_config(
        tmp_path / "run",
        f"deepspeed.zero_stage={stage}",
        f"training.precision={precision}",
        f"deepspeed.offload_optimizer={offload}",
        "training.max_steps=8",
        "checkpoint.every_steps=4",
        *(["model.lora.enabled=true", "model.lora.target_modules=all-linear"] if lora else []),
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
    # The sample ledger lists that step's samples as skipped; no sample is read twice.
    lines = [json.loads(line) for line in ledger.read_text().splitlines()]
    assert {line["step"] for line in lines if line.get("skipped")} == {POISONED}
    ids = [i for line in lines for i in line["ids"]]
    assert len(ids) == len(set(ids)) == 8 * 12
    assert f"step {POISONED + 1} was not applied" in output

    losses = _losses(run_dir)
    assert not math.isfinite(losses[POISONED + 1])  # the step's own loss, as computed
    assert all(math.isfinite(losses[s]) for s in losses if s != POISONED + 1), losses
    assert _losses(run_dir, "skipped_steps")[8] == 1.0
    weights = FragmentReader(sorted((run_dir.path / "checkpoints" / "step-000008").glob("*.safetensors")))
    assert all(torch.isfinite(weights.full(name)).all() for name in weights.params)
    if precision == "fp32" and not lora:  # the reference loop trains every weight
        # Exactly the plain PyTorch loop that leaves that batch out (its step not taken), at every step.
        dataset = dataset_from_config(cfg)
        want, model = train_reference(cfg, dataset, 8, skipped=frozenset({POISONED}))
        split, _ = train_reference(cfg, dataset, 8, micro_batches=6, skipped=frozenset({POISONED}))
        finite = [s for s in range(8) if s != POISONED]
        noise = max(abs(want[s] - split[s]) for s in finite)
        tol = 10 * max(noise, 1.2e-7 * max(want[s] for s in finite))
        worst = max(abs(losses[s + 1] - want[s]) for s in finite)
        assert worst <= tol, (worst, tol, losses, want)
        trained = dict(model.named_parameters())
        for name in weights.params:
            assert torch.allclose(
                weights.full(name).view_as(trained[name]), trained[name].detach(), atol=1e-5
            ), name
