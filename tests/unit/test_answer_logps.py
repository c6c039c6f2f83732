"""Answer log-probabilities of a real transformers model (model/answer_logps.py): the labelled tokens'
log-probabilities summed per row, pairs as two halves of one micro-batch, and a LoRA model's reference
as the same model with its adapters off."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from elastictrain.model.answer_logps import IGNORE, answer_logps, as_reference, pair_logps
from elastictrain.model.preference_loss import dpo


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(config).eval()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """2 pairs: rows 0-1 the chosen answers, rows 2-3 the rejected ones; prompts of 3 tokens."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (4, 9), generator=g)
    labels = ids.clone()
    labels[:, :3] = IGNORE  # the prompt
    labels[1, 7:] = IGNORE  # a shorter chosen answer (padding)
    return ids, labels


def test_answer_logps_sum_the_labelled_tokens_log_probabilities(model):
    ids, labels = batch()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    logps, tokens = answer_logps(logits, labels)
    for row in range(4):
        want = 0.0
        for t in range(1, ids.shape[1]):
            if labels[row, t] != IGNORE:
                want += torch.log_softmax(logits[row, t - 1].double(), -1)[ids[row, t]].item()
        assert logps[row].item() == pytest.approx(want, rel=1e-5)
    assert tokens.tolist() == [6, 4, 6, 6]


def test_pairs_are_the_two_halves_of_one_micro_batch(model):
    ids, labels = batch()
    with torch.no_grad():
        chosen, rejected, nc, nr = pair_logps(model, ids, labels)
        logps, _ = answer_logps(model(input_ids=ids).logits, labels)
    assert torch.equal(chosen, logps[:2]) and torch.equal(rejected, logps[2:]) and nc.tolist() == [6, 4]
    with pytest.raises(ValueError, match="even number of rows"):
        pair_logps(model, ids[:3], labels[:3])


def test_a_lora_models_reference_is_its_base_with_the_adapters_off(model):
    from peft import LoraConfig, get_peft_model

    base = copy.deepcopy(model)
    wrapped = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    ids, labels = batch()
    with torch.no_grad():
        start = pair_logps(wrapped, ids, labels)
        with as_reference(wrapped):
            ref = pair_logps(wrapped, ids, labels)
    # peft starts B at zero: before the first update the policy is its reference, and DPO's loss ln 2
    assert dpo(start[0], start[1], ref[0], ref[1]).losses.tolist() == pytest.approx(
        [math.log(2)] * 2, abs=1e-7
    )
    for name, p in wrapped.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.5)
    with torch.no_grad():
        moved = pair_logps(wrapped, ids, labels)
        with as_reference(wrapped):
            ref_after = pair_logps(wrapped, ids, labels)
        plain = pair_logps(base, ids, labels)
    assert torch.allclose(ref_after[0], plain[0], atol=1e-5) and torch.allclose(
        ref_after[1], plain[1], atol=1e-5
    )
    assert not torch.allclose(moved[0], plain[0], atol=1e-3)
    with (
        pytest.raises(ValueError, match="reference log-probabilities computed before training"),
        as_reference(base),
    ):
        pass
