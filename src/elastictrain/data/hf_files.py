"""Hugging Face `datasets` on local files (JSON lines, CSV, Parquet, plain text), tokenized for a causal LM.

Nothing is downloaded: the files and the tokenizer folder are local, and the hub is switched off. The
result is a map-style `datasets.Dataset` in torch format, so the global data order applies to it as to
any other dataset.

- packing (default): every record's tokens plus the end-of-text token, concatenated and cut into
  blocks of exactly `data.seq_len` (the tail that does not fill a block is dropped). Every sample has
  the same number of tokens, so each micro-batch's mean loss carries the same weight at any world size.
- padding: one record per sample, truncated or padded to `data.seq_len`; padded positions get label
  -100. Micro-batches then hold different numbers of real tokens, so the loss (a mean over tokens of
  each micro-batch) weights tokens slightly differently at different world sizes; prefer packing when
  runs must match exactly across sizes.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any

# data.format by data.path's extension (the config check reads it too)
DATA_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


def data_files(data: Any) -> tuple[list[str], str]:
    files = sorted(glob.glob(data.path))
    if not files:
        raise ValueError(f"data.path: got {data.path!r}; no file matches it")
    fmt = data.format or DATA_FORMATS.get(Path(files[0]).suffix)
    if fmt is None:
        known = ", ".join(DATA_FORMATS)
        raise ValueError(f"data.format: missing and {files[0]} has no known extension ({known})")
    return files, fmt


def load_tokenizer(folder: str) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises several types for a bad folder
        raise ValueError(f"data.tokenizer: {folder!r} does not load with AutoTokenizer: {e}") from e


def check_hf_data(data: Any) -> None:
    """Cheap checks on the driver: the tokenizer loads and the first record has `data.text_field`."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    load_tokenizer(data.tokenizer)
    files, fmt = data_files(data)
    if fmt == "text":
        return
    try:
        first = next(iter(datasets.load_dataset(fmt, data_files=files[:1], split="train", streaming=True)))
    except StopIteration:
        raise ValueError(f"data.path: {files[0]} holds no records") from None
    except Exception as e:  # noqa: BLE001 - a parse error of the user's file, reported with the field
        raise ValueError(f"data.path: {files[0]} does not read as {fmt}: {e}") from e
    if data.text_field not in first:
        # Instruction records (alpaca, sharegpt, openai) are a source of their own.
        chat = {"instruction", "output", "conversations", "messages"} & set(first)
        hint = "; instruction records train with data.source=sft" if chat else ""
        raise ValueError(
            f"data.text_field: got {data.text_field!r}; the columns of {files[0]} are "
            f"{', '.join(first)}{hint}"
        )


def build_hf_dataset(data: Any) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    files, fmt = data_files(data)
    raw = datasets.load_dataset(fmt, data_files=files, split="train")
    field = "text" if fmt == "text" else data.text_field
    if field not in raw.column_names:
        raise ValueError(
            f"data.text_field: got {field!r}; the columns of {data.path} are {', '.join(raw.column_names)}"
        )
    tokenizer = load_tokenizer(data.tokenizer)
    seq_len = int(data.seq_len)
    if data.packing:
        out = _packed(raw, tokenizer, field, seq_len)
    else:
        out = _padded(raw, tokenizer, field, seq_len, data.tokenizer)
    if len(out) == 0:
        raise ValueError(
            f"data.seq_len: got {seq_len}; {data.path} holds too little text for one sample of that length"
        )
    return out.with_format("torch")


def _packed(raw: Any, tokenizer: Any, field: str, seq_len: int) -> Any:
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def tokenize(batch: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
        ids = tokenizer([str(t) for t in batch[field]], add_special_tokens=False)["input_ids"]
        return {"ids": [x + eos for x in ids]}

    def blocks(batch: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
        flat = [t for ids in batch["ids"] for t in ids]
        usable = len(flat) // seq_len * seq_len
        return {"input_ids": [flat[i : i + seq_len] for i in range(0, usable, seq_len)]}

    tokens = raw.map(tokenize, batched=True, remove_columns=raw.column_names)
    # One pass over all records in a single batch: blocks span record boundaries, as in pre-training.
    return tokens.map(blocks, batched=True, batch_size=None, remove_columns=["ids"])


def _padded(raw: Any, tokenizer: Any, field: str, seq_len: int, folder: str) -> Any:
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(
                f"data.tokenizer: {folder!r} has neither a pad nor an end-of-text token; padding "
                "(data.packing=false) needs one"
            )
        tokenizer.pad_token = tokenizer.eos_token

    def encode(batch: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
        enc = tokenizer(
            [str(t) for t in batch[field]], truncation=True, max_length=seq_len, padding="max_length"
        )
        labels = [
            [t if m else -100 for t, m in zip(ids, mask, strict=True)]
            for ids, mask in zip(enc["input_ids"], enc["attention_mask"], strict=True)
        ]
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels}

    return raw.map(encode, batched=True, remove_columns=raw.column_names)
