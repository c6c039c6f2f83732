"""Losses that do not depend on the split: padded data's gradient and the validation loss at world sizes 1-3.

One module, one set of warm probe actors (tests/integration/probe.py) joined into attempts at each world
size with the product's own `setup`, `train_step` and `evaluate`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import ray
import torch
from helpers import REPO, tiny_config

pytestmark = pytest.mark.integration

sys.path.insert(0, str(REPO / "examples" / "hf_causal_lm"))
SENTENCES = REPO / "examples" / "data" / "sentences.jsonl"
LR = 0.5


def padded_sft_config(tmp_path: Path, *overrides: str):  # noqa: ANN201
    """Records of 9 to 17 tokens padded to 32 (labels -100 on padding), plain SGD, no clipping.

    With SGD the parameters after one step are p0 - lr * gradient, so comparing them compares gradients.
    """
    from prepare import build_tokenizer  # examples/hf_causal_lm/prepare.py: a local word-level tokenizer

    texts = [json.loads(line)["text"] for line in SENTENCES.read_text().splitlines() if line.strip()]
    vocab = len(build_tokenizer(texts, tmp_path / "tokenizer"))
    ds_json = tmp_path / "sgd.json"
    ds_json.write_text(
        json.dumps(
            {
                "zero_optimization": {"stage": 3},
                "optimizer": {"type": "SGD", "params": {"lr": LR}},
                "zero_allow_untested_optimizer": True,
            }
        )
    )
    return tiny_config(
        tmp_path / "run",
        "data.source=hf",
        f"data.path={SENTENCES}",
        f"data.tokenizer={tmp_path / 'tokenizer'}",
        "data.packing=false",
        "data.seq_len=32",
        f"model.hf_config.vocab_size={vocab}",
        "training.global_batch_size=6",
        "training.micro_batch_size=2",
        "training.lr_schedule=constant",
        "training.warmup_steps=0",
        f"training.lr={LR}",
        f"deepspeed.config_file={ds_json}",
        "failure.collective_timeout_s=300",  # a cold actor on a busy machine joins late
        *overrides,
    )


def one_step_gradient(
    probes, cfg, world_size: int, before: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:  # noqa: ANN001
    probes.setup(cfg, world_size)
    results = ray.get([a.train_step.remote(0) for a in probes.active], timeout=300)
    assert sum(r["samples"] for r in results) == cfg.training.global_batch_size
    after = probes.full_parameters()
    return {name: (before[name] - after[name]) / LR for name in before}


def test_padded_data_gives_the_same_gradient_at_world_sizes_1_2_and_3(probes, tmp_path):
    cfg = padded_sft_config(tmp_path)
    ray.get([a.warmup.remote(cfg) for a in probes.actors], timeout=600)  # imports and data, all at once
    probes.setup(cfg, 1)
    before = probes.full_parameters()
    grads = {w: one_step_gradient(probes, cfg, w, before) for w in (1, 2, 3)}
    # At world size 1 the step is 3 micro-batches of 2 on one rank; at 3, one micro-batch on each rank:
    # averaging per micro-batch would weigh a token by 1/(its micro-batch's tokens) and move these by ~1e-2.
    scale = max(float(g.abs().max()) for g in grads[1].values())
    assert scale > 0
    for w in (2, 3):
        worst = max(float((grads[w][n] - grads[1][n]).abs().max()) for n in before)
        assert worst <= 1e-5 * scale, f"world size {w}: gradient differs by {worst} (scale {scale})"


def evaluate(probes, step: int) -> tuple[dict[str, float], set[int]]:  # noqa: ANN001
    from elastictrain.core.losses import eval_summary

    shares = ray.get([a.evaluate.remote(step) for a in probes.active], timeout=300)
    return eval_summary(shares), {i for s in shares for i in s["sample_ids"]}


def test_validation_is_the_same_at_world_sizes_1_2_and_3_and_after_a_resize_and_never_trained_on(
    probes, tmp_path
):
    from probe import save_checkpoint

    from elastictrain.core.data_order import held_out

    cfg = padded_sft_config(tmp_path, "eval.split=0.1", "eval.steps=2")
    ray.get([a.warmup.remote(cfg) for a in probes.actors], timeout=600)
    probes.setup(cfg, 2)
    trained: set[int] = set()
    for step in range(3):
        results = ray.get([a.train_step.remote(step) for a in probes.active], timeout=300)
        trained.update(i for r in results for i in r["sample_ids"])
    ckpt = save_checkpoint(probes, cfg, tmp_path / "ckpt", 3)
    at_two, read = evaluate(probes, 3)
    # A resize: the checkpoint saved at 2 loaded at 1 and at 3, evaluated there.
    found = {2: at_two}
    for world in (1, 3):
        probes.setup(cfg, world, checkpoint_dir=str(ckpt), step=3)
        found[world], read_there = evaluate(probes, 3)
        assert read_there == read
    # 2 batches of 6 samples of the 84 held out (10% of 843 records), at every world size
    assert found[1]["eval_samples"] == 12 and found[1]["eval_tokens"] > 12 * 8
    for world in (2, 3):
        assert found[world]["eval_tokens"] == found[1]["eval_tokens"]
        assert found[world]["eval_loss"] == pytest.approx(found[1]["eval_loss"], rel=1e-6, abs=0)
    held = set(held_out(843, 0.1, cfg.training.seed)[1])
    assert read <= held and not trained & held  # the training ledger never holds a validation sample
    assert len(trained) == 3 * 6
