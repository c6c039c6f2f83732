"""Variable-length SFT records as batches: padded to the micro-batch's longest record, or packed in bins.

A record is {"input_ids": LongTensor[L], "labels": LongTensor[L]} (labels -100 where not trained).

- `data.packing: false`: one record per sample; a micro-batch is padded to its longest record (not to
  seq_len), with the tokenizer's pad id (else 0), labels -100 and attention_mask 0 on padding.
- `data.packing: true`: a sample is a bin of whole records, at most seq_len tokens (core/packing.py:
  first-fit in dataset order, once, when the dataset is built). Position ids restart at 0 in every
  record, and no record attends to another:
  - sdpa / eager / flex attention: transformers finds the records from the position ids (masking_utils:
    `find_packed_sequence_indices`) and builds a block-diagonal causal mask, but only when the forward
    has no attention_mask and no cache; a training forward builds a cache unless `use_cache=False`,
    so the batch carries that flag.
  - flash attention: the batch carries `cu_seq_lens_q/k` and `max_length_q/k` (what transformers'
    DataCollatorWithFlattening returns), so the varlen kernel runs over the flattened rows with a
    boundary at every record; the other implementations ignore these keywords.
  Each record after a bin's first has its first label set to -100: the token before it (the previous
  record's last) must not be trained to predict it. Alone, that label is never used either (labels
  are shifted by one), so a packed record's loss and target tokens are exactly its own.

Padding of a packed micro-batch (bins of different lengths) is a sequence of its own, positions from 0.
The loss is the built-in sum over target tokens divided by the global batch's count
(model/loss.py), so neither padding nor packing changes it at any world size or split.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from elastictrain.core.packing import bin_fill, first_fit_bins

IGNORE_INDEX = -100
_RECORD_KEYS = {"input_ids", "labels", "attention_mask", "position_ids"}


def record_lengths(records: Any) -> list[int]:
    """Each record's token count: the dataset's `lengths()` when it has one (no item is built), else
    read from every item."""
    lengths = getattr(records, "lengths", None)
    if lengths is not None:
        return [int(n) for n in (lengths() if callable(lengths) else lengths)]
    return [int(torch.as_tensor(records[i]["input_ids"]).numel()) for i in range(len(records))]


def pad_token_id(dataset: Any) -> int:
    """The pad id of a dataset's tokenizer (`pad_token_id`, found through views and packing), else 0."""
    seen = 0
    while dataset is not None and seen < 8:
        pad = getattr(dataset, "pad_token_id", None)
        if isinstance(pad, int):
            return pad
        dataset = getattr(dataset, "records", None) or getattr(dataset, "dataset", None)
        seen += 1
    return 0


class PackedRecords:
    """Map-style dataset: sample i is bin i, its records concatenated, with restarting position ids."""

    def __init__(self, records: Any, seq_len: int, lengths: Sequence[int] | None = None) -> None:
        self.records = records
        self.seq_len = int(seq_len)
        self.lengths = list(lengths) if lengths is not None else record_lengths(records)
        if len(self.lengths) != len(records):
            raise ValueError(f"packing: {len(self.lengths)} lengths for {len(records)} records")
        self.bins = first_fit_bins(self.lengths, self.seq_len)
        self.fill = bin_fill(self.lengths, self.bins, self.seq_len)

    @property
    def pad_token_id(self) -> int:
        return pad_token_id(self.records)

    def __len__(self) -> int:
        return len(self.bins)

    def record_ids(self, index: int) -> list[int]:
        """The indices (in the record dataset) of the records bin `index` holds, in order."""
        return list(self.bins[index])

    def origin(self, index: int) -> str:
        """Where bin `index`'s records come from (the record dataset's `origin`, else their indices)."""
        named = getattr(self.records, "origin", None)
        ids = self.record_ids(index)
        return "; ".join(named(r) for r in ids) if callable(named) else f"records {ids}"

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        ids, labels, positions = [], [], []
        for r in self.bins[index]:
            item = self.records[r]
            tokens = torch.as_tensor(item["input_ids"], dtype=torch.long).reshape(-1)
            if tokens.numel() == 0:
                continue
            target = torch.as_tensor(item.get("labels", tokens), dtype=torch.long).reshape(-1).clone()
            if ids:
                target[0] = IGNORE_INDEX  # not predicted from the previous record's last token
            ids.append(tokens)
            labels.append(target)
            positions.append(torch.arange(tokens.numel()))
        if not ids:
            raise ValueError(f"packing: bin {index} holds only empty records")
        return {
            "input_ids": torch.cat(ids),
            "labels": torch.cat(labels),
            "position_ids": torch.cat(positions),
        }


def is_record_batch(items: Sequence[Any]) -> bool:
    """Whether the default collate pads these: dicts of 1-D input_ids of unequal lengths, or packed bins."""
    first = items[0]
    if not isinstance(first, Mapping) or not isinstance(first.get("input_ids"), torch.Tensor):
        return False
    if first["input_ids"].dim() != 1:
        return False
    return "position_ids" in first or len({int(item["input_ids"].numel()) for item in items}) > 1


def collate_records(items: Sequence[Mapping[str, Any]], pad_id: int = 0) -> dict[str, Any]:
    """One micro-batch of records (padded) or of bins (packed), padded to its longest item."""
    unknown = set().union(*(set(item) for item in items)) - _RECORD_KEYS
    if unknown:
        raise ValueError(
            f"data.collate: not set, and records of unequal length have keys {sorted(unknown)} the default "
            "collate cannot pad; return only input_ids and labels, or give data.collate"
        )
    packed = "position_ids" in items[0]
    width = max(int(item["input_ids"].numel()) for item in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    labels = torch.full((len(items), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    positions = torch.zeros((len(items), width), dtype=torch.long)
    for row, item in enumerate(items):
        tokens = item["input_ids"].reshape(-1)
        n = tokens.numel()
        ids[row, :n] = tokens
        labels[row, :n] = torch.as_tensor(item.get("labels", tokens)).reshape(-1)
        mask[row, :n] = torch.as_tensor(item.get("attention_mask", torch.ones(n))).reshape(-1)
        if packed:
            positions[row, :n] = item["position_ids"].reshape(-1)
            positions[row, n:] = torch.arange(width - n)  # padding: a sequence of its own
    if not packed:
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}
    return {"input_ids": ids, "labels": labels, "position_ids": positions, **flash_kwargs(positions)}


def flash_kwargs(positions: torch.Tensor) -> dict[str, Any]:
    """Record boundaries of packed rows, for flash attention's varlen kernel over the flattened rows,
    and `use_cache=False` so that sdpa/eager build their block-diagonal mask from the position ids."""
    flat = positions.reshape(-1)
    starts = (flat == 0).nonzero().reshape(-1)
    cu = torch.cat([starts, torch.tensor([flat.numel()])]).to(torch.int32)
    longest = int(cu.diff().max())
    return {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu.clone(),
        "max_length_q": longest,
        "max_length_k": longest,
        "use_cache": False,
    }
