"""Datasets of a run, and how items become batches.

Any map-style dataset works (len(dataset), dataset[i]): the global data order (core/data_order.py)
picks indices by position, so resuming at any world size neither skips nor repeats a sample.

Built in: a generated (or user-given) text corpus with a byte tokenizer, fixed-length samples. Bytes as
tokens need no vocabulary file and no download; every sample has exactly `seq_len` tokens, so every
micro-batch's mean loss has the same weight and the global batch's gradient is exact at any world size.
Hugging Face `datasets` on local files: data/hf_files.py. Your own: `data.factory`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

BYTE_VOCAB_SIZE = 256

_SUBJECTS = [
    "the fox",
    "a robot",
    "the river",
    "my neighbour",
    "the old train",
    "a small bird",
    "the engineer",
    "every cluster",
    "the worker",
    "a red kite",
    "the controller",
    "our team",
]
_VERBS = [
    "sees",
    "builds",
    "follows",
    "repairs",
    "counts",
    "carries",
    "watches",
    "restarts",
    "trains",
    "finds",
]
_OBJECTS = [
    "a bright lamp",
    "seven stones",
    "the north road",
    "two green boxes",
    "the last checkpoint",
    "a quiet garden",
    "the long report",
    "three blue shards",
    "the warm bread",
    "a paper map",
]
_PLACES = [
    "near the bridge",
    "before dawn",
    "in the valley",
    "after the storm",
    "on the hill",
    "under the stars",
    "at the station",
    "by the sea",
]


def generate_corpus(num_chars: int, seed: int = 0) -> str:
    """Sentences from a small grammar: structured enough that a tiny LM's loss falls visibly."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < num_chars:
        sentence = (
            f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_PLACES)}."
        )
        if rng.random() < 0.3:
            sentence += f" it was step {rng.randrange(1000)}."
        sentence = sentence[0].upper() + sentence[1:] + ("\n" if rng.random() < 0.2 else " ")
        parts.append(sentence)
        size += len(sentence)
    return "".join(parts)[:num_chars]


def encode_bytes(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.long)


class PackedTextDataset:
    """Map-style dataset: sample i is tokens [i*seq_len, (i+1)*seq_len) of the encoded corpus."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        if tokens.numel() < seq_len:
            raise ValueError(
                f"data: the corpus has {tokens.numel()} tokens, fewer than data.seq_len={seq_len}"
            )
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return self.tokens.numel() // self.seq_len

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.tokens[index * self.seq_len : (index + 1) * self.seq_len]

    def batch(self, indices: list[int]) -> torch.Tensor:
        return torch.stack([self[i] for i in indices])


def build_dataset(
    source: str, path: str | None, generated_chars: int, seq_len: int, seed: int
) -> PackedTextDataset:
    if source == "generated":
        text = generate_corpus(generated_chars, seed)
    elif source == "file":
        if path is None:
            raise ValueError("data.path: required when data.source is 'file'")
        text = Path(path).read_text(encoding="utf-8")
    else:
        raise ValueError(f"data.source: got {source!r}; expected 'generated' or 'file'")
    return PackedTextDataset(encode_bytes(text), seq_len)


def dataset_from_config(config: Any) -> Any:
    """The run's map-style dataset, by `data.source`: generated | file | hf | tokens | factory | sft."""
    d = config.data
    if d.source == "factory":
        from elastictrain.user_code import user_dataset

        return user_dataset(config)
    if d.source == "hf":
        from elastictrain.data.hf_files import build_hf_dataset

        return build_hf_dataset(d)
    objective = getattr(config.training, "objective", "lm")
    if d.source == "sft" and objective != "lm":
        from elastictrain.data.preference.dataset import build_preference_dataset

        # Two rows per item (chosen and rejected, or a KTO answer and its mismatched one); never packed.
        return build_preference_dataset(d, config.model.pretrained, objective)
    if d.source == "sft":
        from elastictrain.data.sft.dataset import build_sft_dataset

        # Variable-length {input_ids, labels} records (data/sft/dataset.py); packing bins them.
        records = build_sft_dataset(d, config.model.pretrained)
        if not d.packing:
            return records  # padded to each micro-batch's longest record by the default collate
        from elastictrain.data.sft.packing import PackedRecords

        return PackedRecords(records, d.seq_len)  # a sample is a bin, fixed here (core/packing.py)
    if d.source == "tokens":
        from elastictrain.data.token_data import TokenShards

        return TokenShards(str(d.path), d.seq_len, d.dtype)
    return build_dataset(d.source, d.path, d.generated_chars, d.seq_len, config.training.seed)


def default_collate(items: Sequence[Any], pad_id: int = 0) -> Any:
    """Stack tensors; a dict (or tuple/list) of tensors becomes a dict (tuple) of stacked tensors.

    Records of unequal length ({input_ids, labels} dicts) and packed bins are padded to the longest
    (data/sft/packing.py), with `pad_id`.
    """
    first = items[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(list(items))
    if isinstance(first, Mapping):
        from elastictrain.data.sft.packing import collate_records, is_record_batch

        if is_record_batch(items):
            return collate_records(items, pad_id)
        return {k: default_collate([item[k] for item in items]) for k in first}
    if isinstance(first, tuple | list):
        return type(first)(default_collate(list(col)) for col in zip(*items, strict=True))
    if isinstance(first, int | float | bool):
        return torch.tensor(list(items))
    raise TypeError(
        f"cannot collate items of type {type(first).__name__}; return tensors (or dicts/tuples of them) "
        "from the dataset, or give data.collate"
    )


def collate_items(items: Sequence[Any], collate: Callable[[list[Any]], Any] | None = None) -> Any:
    return (collate or default_collate)(list(items))


def run_collate(dataset: Any, collate: Callable[[list[Any]], Any] | None) -> Callable[[list[Any]], Any]:
    """`data.collate`, else the dataset's own (preference rows), else the default collate padding with
    the dataset's pad id (its tokenizer's)."""
    if collate is not None:
        return collate
    from functools import partial

    from elastictrain.data.preference.dataset import base_rows

    rows = base_rows(dataset)
    if rows is not None:
        return rows.collate

    from elastictrain.data.sft.packing import pad_token_id

    return partial(default_collate, pad_id=pad_token_id(dataset))


def to_device(batch: Any, device: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        return type(batch)(to_device(v, device) for v in batch)
    return batch
