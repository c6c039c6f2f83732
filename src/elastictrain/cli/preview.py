"""CLI command `preview-data`: the first samples of a run's training set as the workers will read them.

Text: each sample decoded, its trained tokens (labels other than -100) marked, in colour on a terminal,
between [[ and ]] otherwise. --json: one object per sample, in dataset order:
{"index": i, "input_ids": [...], "labels": [...]} (labels unshifted, -100 where not trained), plus
every other per-token key a sample carries (position_ids of packed bins). A preference objective's
sample is two rows: {"index": i, "chosen": {...}, "rejected": {...}} (KTO: "answer" and "mismatched",
the row its KL estimate reads, and "desirable").
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.text import Text

from elastictrain.cli.output import err, fail, out

IGNORE_INDEX = -100
TRAINED_STYLE = "bold green"
_EXTRA_KEYS = ("position_ids",)  # per-token keys shown beside input_ids and labels when a sample has them


def preview_data_command(
    overrides: Annotated[
        list[str] | None, typer.Argument(help="dotlist overrides, e.g. data.path=alpaca.json")
    ] = None,
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="YAML config (e.g. conf/tiny-cpu.yaml)")
    ] = None,
    first: Annotated[int, typer.Option("--first", help="how many samples, from the first")] = 3,
    as_json: Annotated[
        bool, typer.Option("--json", help="one JSON object per sample: index, input_ids, labels")
    ] = False,
) -> None:
    """Show the first training samples with their trained tokens marked (or as JSON lines)."""
    from elastictrain.config import ConfigError, load_config

    if config is not None and not config.is_file():
        fail(f"--config: {config} is not a file; give a YAML file such as conf/tiny-cpu.yaml")
    if first < 1:
        fail(f"--first: got {first}; expected >= 1")
    try:
        cfg = load_config(config, overrides or [])
    except ConfigError as e:
        fail(f"invalid configuration:\n{e}")
    dataset = _training_set(cfg)
    shown = min(first, len(dataset))
    if as_json:
        for i in range(shown):
            item = dataset[i]
            rows = preference_rows(item)
            if rows is None:
                typer.echo(json.dumps(json_sample(i, item)))
                continue
            record: dict[str, Any] = {"index": i}
            record.update({name: {"input_ids": ids, "labels": labels} for name, ids, labels in rows})
            if "desirable" in item:
                record["desirable"] = bool(item["desirable"])
            typer.echo(json.dumps(record))
        return
    codec = _codec(cfg)
    for i in range(shown):
        item, origin = dataset[i], sample_origin(dataset, i)
        rows = preference_rows(item) or [("", *sample_tokens(item))]
        for name, ids, labels in rows:
            trained = sum(1 for t in labels[1:] if t != IGNORE_INDEX)
            kind = f"{name}  " if name else ""
            if name == "answer" and "desirable" in item:
                kind = f"answer ({'desirable' if item['desirable'] else 'undesirable'})  "
            out.print(
                Text(f"--- sample {i}  {kind}{origin}  {len(ids)} tokens, {trained} trained", style="bold"),
                markup=False,
            )
            out.print(marked_text(ids, labels, codec.decode, colour=out.is_terminal), markup=False)
    err.print(f"{shown} of {len(dataset)} samples")


def preference_rows(item: Any) -> list[tuple[str, list[int], list[int]]] | None:
    """A preference item's two rows as (name, input_ids, labels), the answers trained; None for others."""
    if not isinstance(item, Mapping) or "first" not in item:
        return None
    names = ("answer", "mismatched") if "desirable" in item else ("chosen", "rejected")
    prompt = list(item["prompt"])
    return [
        (name, prompt + list(answer), [IGNORE_INDEX] * len(prompt) + list(answer))
        for name, answer in zip(names, (item["first"], item["second"]), strict=True)
    ]


def sample_origin(dataset: Any, index: int) -> str:
    """Where a sample comes from ('FILE record N'), through held-out views and packed bins; '' if unknown."""
    if callable(getattr(dataset, "source_index", None)):  # eval.split's view of the training samples
        return sample_origin(dataset.dataset, dataset.source_index(index))
    if callable(getattr(dataset, "record_ids", None)):  # a packed bin of records (data/sft/packing.py)
        records = dataset.record_ids(index)
        shown = ", ".join(sample_origin(dataset.records, r) for r in records[:2])
        return f"{len(records)} records: {shown}{', ...' if len(records) > 2 else ''}"
    origin = getattr(dataset, "origin", None)
    return str(origin(index)) if callable(origin) else ""


def _training_set(cfg: Any) -> Any:
    """The samples training reads (after eval.split's hold-out), as the workers build them."""
    from elastictrain.data.eval_data import train_and_eval_datasets
    from elastictrain.data.sft.dataset import SftDataError

    try:
        return train_and_eval_datasets(cfg)[0]
    except (SftDataError, ValueError) as e:
        fail(str(e))


def _codec(cfg: Any) -> Any:
    from elastictrain.core.prompts import BYTES, prompt_tokenizer
    from elastictrain.data.hf_files import load_tokenizer
    from elastictrain.worker.generate import ByteCodec, TokenizerCodec

    source = prompt_tokenizer(cfg.data, cfg.model.pretrained)
    if source is None:
        fail("data.tokenizer: missing; preview-data decodes samples with it (or model.pretrained's)")
    if source == BYTES:
        return _Decoder(ByteCodec())
    return _Decoder(TokenizerCodec(load_tokenizer(source), chat=False, special_tokens=True))


class _Decoder:
    """A codec's decode, special tokens (the template's markers) kept in the text."""

    def __init__(self, codec: Any) -> None:
        self.codec = codec

    def decode(self, ids: list[int]) -> str:
        return str(self.codec.decode(ids, skip_special=False))


def sample_tokens(item: Any) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of a sample: a mapping's, or a tensor of token ids (every token trained)."""
    import torch

    if isinstance(item, Mapping):
        ids = torch.as_tensor(item["input_ids"]).reshape(-1).tolist()
        labels = item.get("labels")
        return ids, ids if labels is None else torch.as_tensor(labels).reshape(-1).tolist()
    ids = torch.as_tensor(item).reshape(-1).tolist()
    return ids, ids


def json_sample(index: int, item: Any) -> dict[str, Any]:
    """{"index", "input_ids", "labels"}, and position_ids where the sample has them (packed bins)."""
    import torch

    ids, labels = sample_tokens(item)
    record: dict[str, Any] = {"index": index, "input_ids": ids, "labels": labels}
    if isinstance(item, Mapping):
        for key in _EXTRA_KEYS:
            if key in item:
                record[key] = torch.as_tensor(item[key]).reshape(-1).tolist()
    return record


def marked_text(ids: list[int], labels: list[int], decode: Any, *, colour: bool) -> Text:
    """The sample's text, runs of trained tokens styled (colour) or between [[ and ]]."""
    text = Text()
    start = 0
    while start < len(ids):
        trained = labels[start] != IGNORE_INDEX
        end = start
        while end < len(ids) and (labels[end] != IGNORE_INDEX) == trained:
            end += 1
        piece = decode(ids[start:end])
        if not trained:
            text.append(piece)
        elif colour:
            text.append(piece, style=TRAINED_STYLE)
        else:
            text.append(f"[[{piece}]]")
        start = end
    return text
