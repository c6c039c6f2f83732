"""Issue 37 point 5: padded and packed SFT records give the same losses at 1, 2 and 3 workers.

Real DeepSpeed ZeRO-3 engines in warm probe actors (tests/integration/probe.py), trained 3 steps from
the same initialization at each world size, on records padded to each micro-batch's longest (data.packing
false) or packed into bins of seq_len (data.packing true, data/sft/packing.py). A global batch of 12
splits as 6 micro-batches of 2 on one rank, 3 on each of 2, 2 on each of 3. The records are
`data.source: sft`'s (80 ShareGPT records of 28 to 128 tokens, ChatML, tests/sft_fixtures.py); records
handed over by value as data.factory reach the workers as any user object does (test_user_code_errors.py).

The reference is plain PyTorch in this process: every record run alone (no padding, no packing, no
mask), its summed token losses divided by the global batch's target tokens, AdamW and clipping as the
run's. The tolerance is derived as in test_plain_pytorch_equivalence.py: the same reference run once
more with each global batch as one padded forward differs only by the order of floating-point sums;
10x that difference (or one fp32 ulp of the loss) is the bound. A mean per micro-batch instead of per
target token of the global batch is shown to move the losses past it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from helpers import tiny_config
from reference import reference_model

from elastictrain.core.data_order import sample_at
from elastictrain.core.losses import step_loss
from elastictrain.core.schedule import step_learning_rate
from elastictrain.data.sft.packing import PackedRecords
from elastictrain.data.sources import dataset_from_config, default_collate
from elastictrain.model.loss import IGNORE_INDEX

pytestmark = pytest.mark.integration

STEPS = 3
FP32_EPS = float(torch.finfo(torch.float32).eps)


@pytest.fixture(scope="module")
def sharegpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a ChatML tokenizer folder, 80 ShareGPT records)."""
    from sft_fixtures import make_chatml_tokenizer, write_records

    root = tmp_path_factory.mktemp("sft")
    return make_chatml_tokenizer(root / "tokenizer"), write_records(root, "sharegpt", 80)


def sft_config(tmp_path: Path, packing: bool, sharegpt: tuple[Path, Path]) -> tuple[Any, Any]:
    """(config, its dataset as every worker builds it)."""
    tokenizer, path = sharegpt
    cfg = tiny_config(
        tmp_path / "run",
        "data.source=sft",
        f"data.path={path}",
        f"data.tokenizer={tokenizer}",
        "data.seq_len=128",
        f"data.packing={str(packing).lower()}",
        "training.global_batch_size=12",
        "training.micro_batch_size=2",
        f"training.max_steps={STEPS}",
        "training.warmup_steps=1",
        "failure.collective_timeout_s=300",  # a cold actor on a busy machine joins late
    )
    return cfg, dataset_from_config(cfg)


def records_of(dataset: Any, index: int) -> list[dict[str, torch.Tensor]]:
    if isinstance(dataset, PackedRecords):
        return [dataset.records[r] for r in dataset.record_ids(index)]
    return [dataset[index]]


def summed_loss(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, int]:
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    labels = batch["labels"][..., 1:].reshape(-1)
    flat = logits[..., :-1, :].reshape(-1, logits.shape[-1]).float()
    loss = torch.nn.functional.cross_entropy(flat, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, int((labels != IGNORE_INDEX).sum())


def reference_losses(cfg: Any, dataset: Any, how: str) -> list[float]:
    """Plain PyTorch losses of STEPS steps. how: `alone` (each record its own forward), `padded` (the
    global batch's records in one padded forward), `micro-mean` (the mean of each micro-batch of 2
    samples' mean: the normalization this issue rules out)."""
    t = cfg.training
    model = reference_model(cfg)
    model.train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, weight_decay=0.0
    )
    losses = []
    for step in range(STEPS):
        lr = step_learning_rate(step, t)
        for group in opt.param_groups:
            group["lr"] = lr
        n, g = len(dataset), t.global_batch_size
        samples = [sample_at(p, n, t.seed) for p in range(step * g, (step + 1) * g)]
        if how == "micro-mean":
            parts = [
                [rec for s in samples[i : i + 2] for rec in records_of(dataset, s)] for i in range(0, g, 2)
            ]
        else:
            records = [rec for s in samples for rec in records_of(dataset, s)]
            parts = [[rec] for rec in records] if how == "alone" else [records]
        sums = [summed_loss(model, default_collate(part)) for part in parts]
        total = sum(count for _, count in sums)
        if how == "micro-mean":
            loss = sum(s / c for s, c in sums) / len(sums)
        else:
            loss = sum(s for s, _ in sums) / total
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        assert math.isfinite(losses[-1])
    return losses


def run_losses(probes: Any, cfg: Any, world_size: int) -> list[float]:
    probes.setup(cfg, world_size)
    losses = []
    for step in range(STEPS):
        results = ray.get([a.train_step.remote(step) for a in probes.active], timeout=300)
        assert sum(r["samples"] for r in results) == cfg.training.global_batch_size
        losses.append(step_loss(results))
    return losses


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_sft_losses_are_the_same_at_world_sizes_1_2_and_3(probes, tmp_path, sharegpt, packing):
    cfg, dataset = sft_config(tmp_path, packing, sharegpt)
    # Records of several tokens each, packed into bins of several records.
    assert isinstance(dataset, PackedRecords) == packing
    assert not packing or len(dataset) < len(dataset.records) * 0.6
    want = reference_losses(cfg, dataset, "alone")
    noise = max(abs(a - b) for a, b in zip(want, reference_losses(cfg, dataset, "padded"), strict=True))
    tol = 10 * max(noise, FP32_EPS * max(want))
    wrong = max(abs(a - b) for a, b in zip(want, reference_losses(cfg, dataset, "micro-mean"), strict=True))
    assert wrong > 10 * tol, f"a per-micro-batch mean moves the losses by only {wrong} (tolerance {tol})"
    ray.get([a.warmup.remote(cfg) for a in probes.actors], timeout=600)
    found = {w: run_losses(probes, cfg, w) for w in (1, 2, 3)}
    report = "\n".join(f"  {w} workers: {[f'{x:.7f}' for x in got]}" for w, got in found.items())
    for w, got in found.items():
        worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
        assert worst <= tol, (
            f"{w} workers differ from the reference by {worst} > {tol}:\n{report}\n  want {want}"
        )
    kind = "packed" if packing else "padded"
    print(f"\n{kind}: tolerance {tol:.2e} (noise {noise:.2e}), wrong {wrong:.2e}")
    for w, got in found.items():
        print(f"  {w} workers: worst {max(abs(a - b) for a, b in zip(got, want, strict=True)):.2e}")
