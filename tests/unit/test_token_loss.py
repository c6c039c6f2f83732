"""The built-in loss is a sum over target tokens, divided by the global batch's count: split-independent."""

from __future__ import annotations

import math

import pytest
import torch

from elastictrain.core.losses import perplexity, step_loss
from elastictrain.model.loss import causal_lm_loss_sum, target_tokens


def _tiny_lm() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    return AutoModelForCausalLM.from_config(cfg).eval()


def _padded_batch() -> dict[str, torch.Tensor]:
    """Four samples of 3, 8, 5 and 2 real tokens, right-padded to 8 (labels -100 on padding)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 32, (4, 8), generator=g)
    mask = torch.zeros(4, 8, dtype=torch.long)
    for row, n in enumerate((3, 8, 5, 2)):
        mask[row, :n] = 1
    labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def test_target_tokens_counts_shifted_labels_that_are_not_ignored():
    batch = _padded_batch()
    assert target_tokens(batch) == (3 - 1) + (8 - 1) + (5 - 1) + (2 - 1)
    assert target_tokens(torch.zeros(2, 5, dtype=torch.long)) == 2 * 4  # token ids: every next token


def test_summed_loss_over_count_is_the_transformers_loss_of_the_batch():
    model, batch = _tiny_lm(), _padded_batch()
    with torch.no_grad():
        summed, count = causal_lm_loss_sum(model, batch)
        reference = model(**batch).loss
    assert count == target_tokens(batch)
    assert float(summed) / count == pytest.approx(float(reference), rel=1e-6)


def test_micro_batch_sums_over_the_global_count_equal_the_whole_batch_mean_but_micro_means_do_not():
    model, batch = _tiny_lm(), _padded_batch()
    halves = [{k: v[i : i + 2] for k, v in batch.items()} for i in (0, 2)]
    with torch.no_grad():
        whole, count = causal_lm_loss_sum(model, batch)
        parts = [causal_lm_loss_sum(model, h) for h in halves]
        micro_means = [float(s) / n for s, n in parts]
    assert sum(n for _, n in parts) == count
    assert sum(float(s) for s, _ in parts) / count == pytest.approx(float(whole) / count, rel=1e-6)
    # What averaging per micro-batch gave: another number, so the split changed the loss (and gradient).
    assert abs(sum(micro_means) / 2 - float(whole) / count) > 1e-3


def test_step_loss_weighs_ranks_by_their_target_tokens():
    results = [
        {"loss": 2.0, "loss_sum": 20.0, "target_tokens": 10},
        {"loss": 1.0, "loss_sum": 30.0, "target_tokens": 30},
    ]
    assert step_loss(results) == pytest.approx(50.0 / 40)
    assert step_loss([{"loss": 2.0}, {"loss": 1.0}]) == pytest.approx(1.5)  # a loss of your own: the mean


def test_perplexity_is_exp_of_the_loss_and_inf_on_overflow():
    assert perplexity(math.log(7.0)) == pytest.approx(7.0)
    assert perplexity(1e6) == math.inf
