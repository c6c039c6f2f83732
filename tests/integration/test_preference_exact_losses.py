"""Issue 58 point 4: preference objectives give the same per-step losses at 1, 2 and 3 workers as a plain
PyTorch loop, and DPO starts at ln 2.

Real DeepSpeed ZeRO-3 engines in warm probe actors (tests/integration/probe.py), trained 3 steps from the
same initialization at each world size, on 48 LLaMA-Factory sharegpt ranking pairs (or KTO records) of a
ChatML tokenizer trained in the test. A global batch of 6 items splits as 3 micro-batches of 2 on one
rank, 3 x 1 on each of 2, 2 x 1 on each of 3.

The reference is plain PyTorch in this process, written from the published formulas (not the product's
loss code): every item run alone (its two rows, no padding beside other items), summed answer
log-probabilities, the loss's mean over the global batch's items, AdamW and clipping as the run's. A
full fine-tune's reference log-probabilities are the starting model's, each item alone; a LoRA run's the
model with its adapters off. The tolerance is derived as the SFT exactness tests derive theirs: the same
reference with each global batch as one padded forward differs only by floating-point order; 10x that
(or one fp32 ulp of the loss) is the bound.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
import torch.nn.functional as F
from helpers import tiny_config
from reference import reference_model

from elastictrain.core.data_order import sample_at
from elastictrain.core.losses import preference_figures, step_loss
from elastictrain.core.schedule import step_learning_rate
from elastictrain.data.preference import reference as store
from elastictrain.data.sources import dataset_from_config

pytestmark = pytest.mark.integration

STEPS = 3
FP32_EPS = float(torch.finfo(torch.float32).eps)
BETA = 0.1


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a ChatML tokenizer folder, a LLaMA-Factory data folder with entries `pairs` and `kto`)."""
    from preference_fixtures import write_kto, write_pairs
    from sft_fixtures import make_chatml_tokenizer

    root = tmp_path_factory.mktemp("preference")
    folder = write_pairs(root / "data", 48)
    write_kto(folder, 48)
    return make_chatml_tokenizer(root / "tokenizer"), folder


def preference_config(tmp_path: Path, data: tuple[Path, Path], objective: str, lora: bool) -> Any:
    tokenizer, folder = data
    return tiny_config(
        tmp_path / "run",
        "data.source=sft",
        f"data.dataset_dir={folder}",
        f"data.dataset={'kto' if objective == 'kto' else 'pairs'}",
        f"data.tokenizer={tokenizer}",
        "data.seq_len=64",
        f"training.objective={objective}",
        f"preference.beta={BETA}",
        f"model.lora.enabled={str(lora).lower()}",
        "model.lora.target_modules=all-linear",
        "training.global_batch_size=6",
        "training.micro_batch_size=2",
        f"training.max_steps={STEPS}",
        "training.warmup_steps=1",
        "training.lr=1e-2",
        "failure.collective_timeout_s=300",
    )


# ---------------------------------------------------------------- the plain PyTorch loop
def rows_of(dataset: Any, indices: list[int]) -> dict[str, torch.Tensor]:
    """The items' rows padded together: every first row, then every second row."""
    items = [dataset[i] for i in indices]
    pairs = [(it["prompt"], it["first"]) for it in items] + [(it["prompt"], it["second"]) for it in items]
    width = max(len(p) + len(a) for p, a in pairs)
    ids = torch.zeros((len(pairs), width), dtype=torch.long)
    answer = torch.zeros((len(pairs), width), dtype=torch.bool)
    mask = torch.zeros((len(pairs), width), dtype=torch.long)
    for r, (p, a) in enumerate(pairs):
        ids[r, : len(p) + len(a)] = torch.tensor(p + a)
        answer[r, len(p) : len(p) + len(a)] = True
        mask[r, : len(p) + len(a)] = 1
    return {"input_ids": ids, "answer": answer, "attention_mask": mask}


def summed_logps(model: torch.nn.Module, rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"]).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(2, rows["input_ids"][:, 1:, None])[..., 0]
    mask = rows["answer"][:, 1:]
    return (logp * mask).sum(-1), mask.sum(-1).float()


def item_losses(
    objective: str, model: Any, rows: dict[str, torch.Tensor], ref: torch.Tensor | None, kl: float, good: Any
) -> torch.Tensor:
    """Per-item losses of the published formulas (DPO sigmoid, ORPO, KTO)."""
    logps, tokens = summed_logps(model, rows)
    half = logps.shape[0] // 2
    if objective == "kto":
        ratio = logps[:half] - ref[:half]
        good = torch.as_tensor(good)
        return torch.where(
            good, 1 - torch.sigmoid(BETA * (ratio - kl)), 1 - torch.sigmoid(BETA * (kl - ratio))
        )
    if objective == "orpo":
        c, r = logps[:half] / tokens[:half], logps[half:] / tokens[half:]
        log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
        return -c - BETA * F.logsigmoid(log_odds)
    margin = (logps[:half] - ref[:half]) - (logps[half:] - ref[half:])
    return -F.logsigmoid(BETA * margin)


def reference_losses(cfg: Any, dataset: Any, start: dict[str, torch.Tensor], how: str) -> list[float]:
    """STEPS steps of plain PyTorch from the workers' starting weights. how: alone | padded."""
    t, objective, lora = cfg.training, cfg.training.objective, cfg.model.lora.enabled
    model = reference_model(cfg)
    if lora:
        from peft import get_peft_model

        from elastictrain.model.lora import peft_config

        model = get_peft_model(model, peft_config(cfg.model.lora, model))
    model.load_state_dict(start)
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        trained, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, weight_decay=0.0
    )
    n = len(dataset)

    def reference_of(indices: list[int]) -> torch.Tensor | None:
        if objective == "orpo":
            return None
        rows = rows_of(dataset, indices)
        with torch.no_grad():
            if lora:
                with model.disable_adapter():
                    return summed_logps(model, rows)[0]
            return table_model(rows)

    table_model_state = {k: v.clone() for k, v in model.state_dict().items()}
    frozen = reference_model(cfg)
    if not lora:
        frozen.load_state_dict(table_model_state)

    def table_model(rows: dict[str, torch.Tensor]) -> torch.Tensor:
        return summed_logps(frozen, rows)[0]

    losses = []
    for step in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = step_learning_rate(step, t)
        g = t.global_batch_size
        samples = [sample_at(p, n, t.seed) for p in range(step * g, (step + 1) * g)]
        kl = 0.0
        if objective == "kto":  # the global batch's mean log-ratio on mismatched rows, clamped, detached
            with torch.no_grad():
                parts = []
                for s in samples:
                    rows = rows_of(dataset, [s])
                    parts.append(summed_logps(model, rows)[0][1] - reference_of([s])[1])
                kl = max(float(torch.stack(parts).mean()), 0.0)
        groups = [[s] for s in samples] if how == "alone" else [samples]
        total = torch.zeros(())
        for part in groups:
            good = [dataset[s].get("desirable") for s in part]
            per_item = item_losses(objective, model, rows_of(dataset, part), reference_of(part), kl, good)
            total = total + per_item.sum()
        loss = total / g
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        assert math.isfinite(losses[-1])
    return losses


# ---------------------------------------------------------------- the workers
def precompute(probes: Any, cfg: Any, folder: Path) -> store.ReferenceTable:
    """The reference pass as the controller drives it (control/reference_pass.py), on the attempt."""
    import numpy as np

    (info,) = ray.get([probes.active[0].reference_items.remote()], timeout=300)
    folder.mkdir(parents=True, exist_ok=True)
    for start, stop in store.chunks(info["items"], size=20):  # chunks cut across ranks' shares
        shares = ray.get([a.reference_logps.remote(start, stop) for a in probes.active], timeout=300)
        values = np.full((stop - start, 2), np.nan, dtype=np.float32)
        for share in shares:
            for i, pair in zip(share["indices"], share["logps"], strict=True):
                values[i - start] = pair
        store.write_chunk(folder, start, values)
    return store.finish(folder, info["items"], info["data_digest"], size=20)


def run_losses(
    probes: Any, cfg: Any, world_size: int, table: Any
) -> tuple[list[float], list[dict[str, float]]]:
    probes.setup(cfg, world_size, reference=table)
    losses, figures = [], []
    for step in range(STEPS):
        results = ray.get([a.train_step.remote(step) for a in probes.active], timeout=300)
        assert sum(r["items"] for r in results) == cfg.training.global_batch_size
        losses.append(step_loss(results))
        figures.append(preference_figures(results))
    return losses, figures


CASES = [("dpo", True), ("dpo", False), ("orpo", False), ("kto", False)]


@pytest.mark.parametrize(("objective", "lora"), CASES, ids=["dpo-lora", "dpo-full", "orpo-full", "kto-full"])
def test_preference_losses_are_the_same_at_world_sizes_1_2_and_3(probes, tmp_path, data, objective, lora):
    cfg = preference_config(tmp_path, data, objective, lora)
    dataset = dataset_from_config(cfg)
    ray.get([a.warmup.remote(cfg) for a in probes.actors], timeout=600)
    probes.setup(cfg, 1)
    start = probes.full_parameters()
    table = None
    if objective != "orpo" and not lora:
        probes.setup(cfg, 2)  # the pass at 2 ranks, training at 1, 2 and 3: the table is world-size free
        table = precompute(probes, cfg, tmp_path / "reference")
    want = reference_losses(cfg, dataset, start, "alone")
    noise = max(
        abs(a - b) for a, b in zip(want, reference_losses(cfg, dataset, start, "padded"), strict=True)
    )
    tol = 10 * max(noise, FP32_EPS * max(abs(x) for x in want))
    assert abs(want[-1] - want[0]) > 100 * tol, f"the loss hardly moves over {STEPS} steps: {want}"
    found = {w: run_losses(probes, cfg, w, table) for w in (1, 2, 3)}
    report = "\n".join(f"  {w} workers: {[f'{x:.7f}' for x in got]}" for w, (got, _) in found.items())
    for w, (got, figures) in found.items():
        worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
        assert worst <= tol, (
            f"{w} workers differ from the reference by {worst} > {tol}:\n{report}\n  want {want}"
        )
        if objective == "dpo":  # before the first update the policy is its reference
            assert abs(got[0] - math.log(2)) <= tol, f"{objective} starts at {got[0]}, not ln 2"
            assert figures[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-5)
            assert set(figures[0]) >= {
                "rewards/chosen",
                "rewards/rejected",
                "rewards/accuracies",
                "logps/chosen",
            }
        if objective == "kto":
            assert {"kl", "rewards/chosen", "rewards/rejected"} <= set(figures[1])
    print(f"\n{objective} (lora {lora}): tolerance {tol:.2e} (noise {noise:.2e})\n{report}\n  want {want}")
