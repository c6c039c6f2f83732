"""Issue 37 point 5: SFT records padded to the micro-batch's longest, or packed into bins of seq_len.

Bin assignment (core/packing.py) is pure and tested on lengths; the tensor side (data/sft/packing.py)
on small synthetic records; a packed record's logits are checked against the record run alone, for
Llama and Qwen2 under sdpa and eager attention (transformers' own mask from the position ids).
"""

from __future__ import annotations

import random

import pytest
import torch

from elastictrain.core.packing import bin_fill, first_fit_bins
from elastictrain.data.eval_data import IndexView
from elastictrain.data.sft.packing import PackedRecords, collate_records, is_record_batch, pad_token_id
from elastictrain.data.sources import default_collate, run_collate
from elastictrain.model.loss import IGNORE_INDEX, causal_lm_loss_sum, target_tokens


def records(lengths: list[int], seed: int = 0, vocab: int = 256) -> list[dict[str, torch.Tensor]]:
    """Records of the given lengths: a prompt (labels -100) then an answer (labels = tokens)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(1, vocab, (n,), generator=g)
        labels = ids.clone()
        labels[: n // 3] = IGNORE_INDEX
        out.append({"input_ids": ids, "labels": labels})
    return out


# -- bin assignment ---------------------------------------------------------------------------------------
def naive_first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    bins: list[list[int]] = []
    room: list[int] = []
    for i, n in enumerate(lengths):
        b = next((b for b, r in enumerate(room) if r >= n), len(bins))
        if b == len(bins):
            bins.append([])
            room.append(capacity)
        bins[b].append(i)
        room[b] -= n
    return bins


def test_bins_are_first_fit_in_order_never_over_seq_len_and_deterministic():
    rng = random.Random(3)
    for _ in range(100):
        capacity = rng.randint(1, 40)
        lengths = [rng.randint(0, capacity) for _ in range(rng.randint(0, 120))]
        bins = first_fit_bins(lengths, capacity)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))  # every record once
        assert all(b == sorted(b) and b for b in bins)  # dataset order inside a bin, no empty bin
        assert [b[0] for b in bins] == sorted(b[0] for b in bins)  # bins in the order they opened
        assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
        assert bins == naive_first_fit(lengths, capacity) == first_fit_bins(lengths, capacity)


def test_bins_examples_and_refusals():
    assert first_fit_bins([5, 5, 6, 12, 4, 3], 16) == [[0, 1, 2], [3, 4], [5]]
    assert first_fit_bins([10, 10, 6, 6], 16) == [[0, 2], [1, 3]]  # the gap of bin 0 is filled first
    assert first_fit_bins([], 8) == []
    assert bin_fill([4, 4, 8], [[0, 1], [2]], 8) == 1.0
    with pytest.raises(ValueError, match=r"data\.seq_len: got 8; record 1 has 9 tokens"):
        first_fit_bins([3, 9], 8)
    with pytest.raises(ValueError, match="data.seq_len"):
        first_fit_bins([1], 0)


# -- padded collate ---------------------------------------------------------------------------------------
def test_unequal_records_are_padded_to_the_longest_with_the_pad_id():
    items = records([3, 7, 5])
    batch = default_collate(items, pad_id=2)
    assert set(batch) == {"input_ids", "labels", "attention_mask"}
    assert batch["input_ids"].shape == (3, 7)  # the longest record, not seq_len
    for row, item in enumerate(items):
        n = item["input_ids"].numel()
        assert torch.equal(batch["input_ids"][row, :n], item["input_ids"])
        assert torch.equal(batch["labels"][row, :n], item["labels"])
        assert (batch["input_ids"][row, n:] == 2).all()
        assert (batch["labels"][row, n:] == IGNORE_INDEX).all()
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (7 - n)
    assert target_tokens(batch) == sum(target_tokens(item["labels"][None]) for item in items)


def test_equal_length_dicts_and_tensors_still_stack():
    items = records([4, 4])
    batch = default_collate(items)
    assert set(batch) == {"input_ids", "labels"} and batch["input_ids"].shape == (2, 4)
    assert not is_record_batch([torch.zeros(3), torch.zeros(3)])
    with pytest.raises(ValueError, match="data.collate"):
        collate_records([{"input_ids": torch.ones(2, dtype=torch.long), "extra": torch.ones(2)}] * 2)


def test_the_run_collate_pads_with_the_tokenizers_pad_id_through_views():
    class Records(list):
        pad_token_id = 7

    data = Records(records([2, 5]))
    collate = run_collate(IndexView(PackedRecords(data, 8), (0,)), None)
    assert collate(records([2, 5]))["input_ids"][0, 2:].tolist() == [7, 7, 7]
    assert pad_token_id(records([1])) == 0
    mine = object()
    assert run_collate(data, mine) is mine  # type: ignore[arg-type]


# -- packed bins --------------------------------------------------------------------------------------------
def test_a_bin_concatenates_its_records_with_restarting_positions():
    data = records([3, 4, 6, 2])
    packed = PackedRecords(data, 8)
    assert [packed.record_ids(i) for i in range(len(packed))] == [[0, 1], [2, 3]]
    item = packed[0]
    assert item["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3]
    assert torch.equal(item["input_ids"], torch.cat([data[0]["input_ids"], data[1]["input_ids"]]))
    want = torch.cat([data[0]["labels"], data[1]["labels"]])
    want[3] = IGNORE_INDEX  # the second record is not predicted from the first's last token
    assert torch.equal(item["labels"], want)
    # Target tokens are each record's own: a first label never counts (labels are shifted).
    assert target_tokens(item["labels"][None]) == sum(target_tokens(d["labels"][None]) for d in data[:2])
    with pytest.raises(IndexError):
        packed[2]


def test_packed_collate_pads_bins_and_marks_record_boundaries():
    packed = PackedRecords(records([3, 4, 6, 2, 5]), 8)
    batch = default_collate([packed[0], packed[1], packed[2]])
    assert "attention_mask" not in batch and batch["use_cache"] is False
    assert batch["input_ids"].shape == (3, 8)
    assert batch["position_ids"].tolist() == [
        [0, 1, 2, 0, 1, 2, 3, 0],
        [0, 1, 2, 3, 4, 5, 0, 1],
        [0, 1, 2, 3, 4, 0, 1, 2],  # padding: a sequence of its own
    ]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 7, 8, 14, 16, 21, 24]
    assert batch["max_length_q"] == 6
    assert (batch["labels"][2, 5:] == IGNORE_INDEX).all()


def tiny(model_type: str, attn: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        model_type,
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation=attn,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_packed_record_has_the_logits_and_loss_it_has_alone(model_type, attn):
    model = tiny(model_type, attn)
    model.train()  # as in training: a forward that would build a cache unless told not to
    data = records([5, 9, 3, 12, 7, 1, 10], seed=1)
    packed = PackedRecords(data, 24)
    batch = default_collate([packed[i] for i in range(len(packed))])
    with torch.no_grad():
        kwargs = {k: v for k, v in batch.items() if k != "labels"}
        logits = model(**kwargs).logits
        worst = 0.0
        for b in range(len(packed)):
            offset = 0
            for r in packed.record_ids(b):
                ids = data[r]["input_ids"]
                alone = model(input_ids=ids[None]).logits[0]
                got = logits[b, offset : offset + ids.numel()]
                worst = max(worst, float((got - alone).abs().max()))
                offset += ids.numel()
        assert worst <= 1e-5, f"{model_type}/{attn}: packed logits differ from alone by {worst}"
        # The packed batch's loss is the sum of the records' own, over the same target tokens.
        summed, count = causal_lm_loss_sum(model, batch)
        alone = [causal_lm_loss_sum(model, {k: v[None] for k, v in d.items()}) for d in data]
        assert count == sum(n for _, n in alone)
        assert float(summed) == pytest.approx(sum(float(s) for s, _ in alone), rel=1e-5)
        # Padded (packing false): the same sum, the same count.
        padded_sum, padded_count = causal_lm_loss_sum(model, default_collate(data))
        assert padded_count == count
        assert float(padded_sum) == pytest.approx(float(summed), rel=1e-5)


def test_a_packed_bin_without_use_cache_false_would_leak_across_records():
    """Guards the guard: transformers skips its packed-sequence mask when the forward builds a cache."""
    model = tiny("llama", "sdpa").eval()
    data = records([6, 6], seed=2)
    batch = default_collate([PackedRecords(data, 12)[0]])
    with torch.no_grad():
        alone = model(input_ids=data[1]["input_ids"][None]).logits[0]
        leaky = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0, 6:]
    assert float((leaky - alone).abs().max()) > 1e-3


def test_eval_prompts_from_a_packed_bin_take_its_first_record():
    from elastictrain.worker.generate import _record_tokens

    data = records([6, 4], seed=3)
    ids, labels, mask = _record_tokens(PackedRecords(data, 16)[0], 1)
    assert ids == data[0]["input_ids"].tolist() and labels == data[0]["labels"].tolist() and mask is None


def test_preview_json_of_a_packed_bin_has_its_position_ids_and_origins():
    from elastictrain.cli.preview import json_sample

    packed = PackedRecords(records([6, 4, 7], seed=4), 12)
    sample = json_sample(0, packed[0])
    assert sample["position_ids"] == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    assert sample["labels"][6] == IGNORE_INDEX
    assert "position_ids" not in json_sample(0, records([6])[0])
    assert packed.origin(0) == "records [0, 1]"
