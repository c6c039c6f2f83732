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

from elastictrain.checkpoint.store import verify
from elastictrain.checkpoint.zero_state import FragmentReader
from elastictrain.data.sources import dataset_from_config
from elastictrain.testing.chaos import at_step

pytestmark = pytest.mark.integration

POISONED = 5  # the step index (0-based) whose first micro-batch on rank 0 comes out NaN: step 6


def _run_with_fault(cfg, kind: str, index: int):  # noqa: ANN001, ANN202
    """Train `cfg`; once 2 steps are done, rank 0 gets fault `kind` at step index `index`."""

    def inject(controller) -> None:  # noqa: ANN001
        ray.get(controller.active[0].actor.inject_fault.remote(kind, index))

    return run(cfg, hook=at_step(2, inject), faults=True)


def _assert_losses_leave_out(
    cfg, run_dir, steps: int, left_out: frozenset[int], from_step: int = 0
) -> torch.nn.Module:  # noqa: ANN001
    """Each logged loss of steps `from_step`..`steps - 1` (0-based) not in `left_out` is the plain PyTorch
    loop's that leaves those batches out, within 10x its summation noise; that loop's model."""
    dataset = dataset_from_config(cfg)
    want, model = train_reference(cfg, dataset, steps, skipped=left_out)
    split, _ = train_reference(cfg, dataset, steps, micro_batches=6, skipped=left_out)
    kept = [s for s in range(steps) if s not in left_out]
    tol = 10 * max(max(abs(want[s] - split[s]) for s in kept), 1.2e-7 * max(want[s] for s in kept))
    losses = _losses(run_dir)
    worst = max(abs(losses[s + 1] - want[s]) for s in kept if s >= from_step)
    assert worst <= tol, (worst, tol, losses, want)
    return model


def _assert_weights(weights: FragmentReader, model: torch.nn.Module) -> None:
    trained = dict(model.named_parameters())
    for name in weights.params:
        assert torch.allclose(weights.full(name).view_as(trained[name]), trained[name].detach(), atol=1e-5), (
            name
        )


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

    summary, run_dir, output = _run_with_fault(cfg, "nan", POISONED)
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
        _assert_weights(weights, _assert_losses_leave_out(cfg, run_dir, 8, frozenset({POISONED})))


# (step done, step index): once `step done` steps are done, a weight of rank 0 turns NaN at the start of the
# step of that index (0-based); the second is asked for after the rollback, which redoes steps 6-9.
CORRUPTED = ((2, 5), (9, 10))


def test_a_weight_gone_bad_rolls_back_to_the_snapshot_before_it_and_gone_bad_again_soon_stops_the_run(
    ray_local: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every step after a corruption is NaN on rank 0 and not applied. After failure.max_bad_steps (3) the
    run returns to the in-memory snapshot of step 5 (clean: taken before), skips the batches of steps 6-8
    and trains as the plain loop that leaves them out. Corrupted again at step 11, within
    failure.bad_steps_window of the first rollback, the run stops naming steps 11-13 and their samples;
    the checkpoint before them (step 8; keep_last=1 would have pruned it) is kept and verifies."""
    ledger = tmp_path / "ledger.jsonl"
    monkeypatch.setenv("ELASTICTRAIN_SAMPLE_LEDGER", str(ledger))
    cfg = tiny_config(
        tmp_path / "run",
        "deepspeed.zero_stage=0",
        "checkpoint.keep_last=1",
        "checkpoint.memory_max_step_share=0",  # a snapshot every step, whatever the copies cost
        "training.max_steps=16",
    )
    asked: set[int] = set()

    def corrupt(controller, _index, _results) -> None:  # noqa: ANN001
        for done, index in CORRUPTED:
            if controller.step == done and index not in asked:
                asked.add(index)
                ray.get(controller.active[0].actor.inject_fault.remote("corrupt", index))

    summary, run_dir, output = run(cfg, hook=lambda c: c.callbacks.after_step.append(corrupt), faults=True)
    assert summary.status.value == "FAILED", output
    events = run_dir.read_events()
    assert [e["step"] for e in events if e["event"] == "bad_step"] == [6, 7, 8, 11, 12, 13]
    (rollback,) = [e for e in events if e["event"] == "rollback"]
    assert rollback["steps"] == [6, 7, 8] and rollback["recovered_from"] == "memory", rollback
    assert "rolling back to the in-memory snapshot at step 5" in output
    assert "step(s) 11, 12, 13 call for a rollback" in summary.message
    assert "within failure.bad_steps_window of the one for step(s) 6, 7, 8" in summary.message
    assert "step 11: 0: [" in summary.message  # its samples, by rank
    assert "The last checkpoint from before them: step-000008" in summary.message
    good = run_dir.path / "checkpoints" / "step-000008"
    assert verify(good).problems == []
    info = run_dir.read_info()
    assert info.skipped_steps == 6 and info.extra["skip_steps"] == [6, 7, 8, 11, 12, 13]
    # The ledger's last word on steps 1-9: steps 6-8 skipped, every other sample read once.
    last: dict[int, dict[int, dict]] = {}
    for line in map(json.loads, ledger.read_text().splitlines()):
        last.setdefault(line["step"], {})[line["rank"]] = line
    assert [s for s in range(9) if all(x.get("skipped") for x in last[s].values())] == [5, 6, 7]
    applied = [i for s in range(9) if s not in (5, 6, 7) for x in last[s].values() for i in x["ids"]]
    assert len(applied) == len(set(applied)) == 6 * 12

    # Step 9, the first after the rollback, as the plain PyTorch loop that leaves steps 6-8 out; and the
    # checkpoint of step 8, saved after the rollback, holds that loop's weights.
    left_out = frozenset({5, 6, 7})
    _assert_losses_leave_out(cfg, run_dir, 9, left_out, from_step=8)
    _, at_8 = train_reference(cfg, dataset_from_config(cfg), 8, skipped=left_out)
    _assert_weights(FragmentReader(sorted(good.glob("*.safetensors"))), at_8)


def test_a_non_finite_step_in_a_tensor_parallel_replica_is_skipped_by_both_of_its_ranks(
    ray_local: None, tmp_path: Path
) -> None:
    """TP 2 x DP 1 (ZeRO-1): rank 0's logits turn NaN at step 6; the replica's two ranks skip the update
    alike (their gradient norm is one all-reduce), the event names the replica's samples once per rank,
    and every other step's loss is the plain PyTorch loop's leaving that batch out."""
    cfg = tiny_config(
        tmp_path / "run",
        "deepspeed.zero_stage=1",
        "scaling.tensor_parallel=2",
        "training.max_steps=8",
        "checkpoint.every_steps=8",
    )

    summary, run_dir, output = _run_with_fault(cfg, "nan", POISONED)
    assert summary.status.value == "FINISHED", output
    assert "1 replica(s) of 2 tensor-parallel ranks" in output
    bads = [e for e in run_dir.read_events() if e["event"] == "bad_step"]
    assert len(bads) == 1, output
    (bad,) = bads
    assert bad["step"] == POISONED + 1 and bad["skipped_ranks"] == [0, 1]
    assert bad["samples"]["0"] == bad["samples"]["1"] and len(bad["samples"]["0"]) == 12  # one replica's
    _assert_losses_leave_out(cfg, run_dir, 8, frozenset({POISONED}))


SPIKED = 6  # the step index (0-based) whose logits on rank 0 come out 30x: step 7's loss spikes


def test_a_loss_spike_rolls_back_to_the_snapshot_before_it_and_trains_as_if_its_batch_were_left_out(
    ray_local: None, tmp_path: Path
) -> None:
    """failure.loss_spike=3 over the last 3 steps' median: step 7's loss is several times the median,
    its update was applied; the run returns to the in-memory snapshot of step 6 (snapshots 2 steps apart
    with spikes watched, none queued past a checkpoint, so one from before the spike is still held),
    skips its batch, and every later step's loss is the plain loop's leaving that batch out."""
    cfg = tiny_config(
        tmp_path / "run",
        "deepspeed.zero_stage=0",
        "training.max_steps=10",
        "checkpoint.every_steps=5",
        "checkpoint.memory_max_step_share=0",
        "failure.loss_spike=3",
        "failure.loss_spike_window=3",
    )

    summary, run_dir, output = _run_with_fault(cfg, "spike", SPIKED)
    assert summary.status.value == "FINISHED", output
    rollbacks = [e for e in run_dir.read_events() if e["event"] == "rollback"]
    assert len(rollbacks) == 1, output
    (rollback,) = rollbacks
    assert rollback["steps"] == [SPIKED + 1] and rollback["cause"] == "loss_spike", rollback
    assert rollback["recovered_from"] == "memory" and "x the median" in rollback["message"], rollback
    assert "rolling back to the in-memory snapshot at step 6" in output
    info = run_dir.read_info()
    assert info.skipped_steps == 1 and info.extra["skip_steps"] == [SPIKED + 1]
    _assert_losses_leave_out(
        cfg, run_dir, 10, frozenset({SPIKED}), from_step=SPIKED + 1
    )  # after the rollback
