"""The map-style dataset of `data.source: sft`: item i is {"input_ids": LongTensor[L], "labels":
LongTensor[L]}, L <= data.seq_len, labels -100 where not trained (unshifted, as transformers takes them).

Built once, in order (datasets as named, files sorted, records as in each file), the same on every
worker, so the global data order stays exact at any world size. Tokens sit in two flat int32 tensors
with offsets: an item is a slice, and no per-record Python object is kept.

A record longer than data.seq_len loses its end (LLaMA-Factory's default side). One whose kept tokens
hold no trained answer token (its prompt alone fills seq_len; with mask_history, its last answer lies
beyond) is dropped and counted, never trained with no target. Records that do not convert (missing
columns, an empty conversation, roles out of order, an answer missing, a template refusing them) are bad:
the build fails naming each (file, record index, field) unless data.on_bad_record is skip, which drops
them and says how many. A rendering that leaves out what a record has (a tool call, a tool, an answer's
content: render.py) refuses the build whatever data.on_bad_record says: the template or data.tool_format
is what needs changing, and skipping would drop every such record.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from elastictrain.core.sft_labels import kept_length, labels_for
from elastictrain.data.sft.dataset_info import Source, sources_and_problems
from elastictrain.data.sft.files import FileProblem, file_format, read_records
from elastictrain.data.sft.records import (
    FORMATTINGS,
    Layout,
    RecordProblem,
    convert,
    detect,
    layout_problems,
    make_layout,
)
from elastictrain.data.sft.render import (
    TemplateProblem,
    chat_tokenizer,
    encode,
    pad_id,
    template_facts,
    template_origin,
)
from elastictrain.data.sft.tool_text import TOOL_FORMATS

log = logging.getLogger("elastictrain.data")
CHUNK = 512  # conversations tokenized per batched call
SHOWN = 10  # bad records named in a message; the rest are counted


class SftDataError(ValueError):
    """Instruction data that cannot train; the message names the field, the files and records."""


@dataclass(frozen=True)
class BadRecord:
    file: str
    index: int  # the record's position in its file, from 0
    field: str
    reason: str

    def line(self) -> str:
        return f"{self.file} record {self.index}: {self.field}: {self.reason}"


@dataclass
class BuildReport:
    """What a build read and left out."""

    records: int = 0
    bad: list[BadRecord] = field(default_factory=list)
    overlong: list[tuple[str, int, int]] = field(default_factory=list)  # (file, record, tokens)
    lost: list[tuple[str, int, list[tuple[str, str]]]] = field(default_factory=list)  # (file, record, parts)

    def bad_message(self) -> str:
        shown = "\n".join(f"  {b.line()}" for b in self.bad[:SHOWN])
        more = f"\n  ... and {len(self.bad) - SHOWN} more" if len(self.bad) > SHOWN else ""
        return (
            f"data: {len(self.bad)} of {self.records} instruction records are bad:\n{shown}{more}\n"
            "Fix them, or set data.on_bad_record=skip to train without them"
        )

    def lost_message(self, origin: str, tool_format: str | None) -> str:
        """Records whose rendering leaves out a call, a tool or an answer's content, and the fix."""
        lines = [
            f"  {f} record {i}: {'; '.join([w for _, w in parts[:3]] + ['...'] * (len(parts) > 3))}"
            for f, i, parts in self.lost[:SHOWN]
        ]
        if len(self.lost) > SHOWN:
            lines.append(f"  ... and {len(self.lost) - SHOWN} more")
        kinds = {k for _, _, parts in self.lost for k, _ in parts}
        what = [w for k, w in (("call", "tool calls"), ("tool", "tools"), ("blank", "answers")) if k in kinds]
        head = (
            f"data: {len(self.lost)} of {self.records} instruction records would train without their "
            f"{' and '.join(what)}: {origin} leaves them out of the rendering"
        )
        if tool_format is None and kinds & {"call", "tool"}:
            fix = (
                "data.tool_format: set it to json or qwen to write the calls and tools into the messages' "
                "text, which any template renders (docs/instruction-data.md, Tool calls), or give "
                "data.template=FILE, a chat template that renders tool_calls and tools"
            )
        else:
            fix = (
                "data.template: give FILE, a chat template that renders every message's content (the "
                f"system turn too{', which holds the tools with data.tool_format' if tool_format else ''})"
            )
        return "\n".join([head, *lines, fix])

    def dropped_message(self, seq_len: int) -> str:
        where = "; ".join(f"{f} record {i}: a prompt of {n} tokens" for f, i, n in self.overlong[:3])
        more = "; ..." if len(self.overlong) > 3 else ""
        return (
            f"data: {len(self.overlong)} record(s) dropped: no answer token fits in data.seq_len={seq_len} "
            f"after the prompt ({where}{more}); raise data.seq_len to keep them"
        )


class SftDataset:
    """Records as (input_ids, labels) slices of flat token tensors."""

    def __init__(
        self,
        ids: torch.Tensor,
        labels: torch.Tensor,
        offsets: torch.Tensor,
        origins: Sequence[tuple[str, int]],
        pad_token_id: int,
        report: BuildReport,
    ) -> None:
        self.ids, self.labels, self.offsets = ids, labels, offsets
        self.origins = list(origins)
        self.pad_token_id = pad_token_id  # what the padding collate fills with (data/sft/packing.py)
        self.report = report

    def __len__(self) -> int:
        return len(self.origins)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        a, b = int(self.offsets[index]), int(self.offsets[index + 1])
        return {"input_ids": self.ids[a:b].long(), "labels": self.labels[a:b].long()}

    def lengths(self) -> list[int]:
        """Each item's token count, without building the items (packing reads these)."""
        return self.offsets.diff().tolist()

    def origin(self, index: int) -> str:
        """Where item `index` comes from: 'FILE record N'."""
        file, record = self.origins[index]
        return f"{file} record {record}"


def _layout(source: Source, path: str, records: Sequence[Any]) -> Layout:
    formatting = source.formatting
    if formatting is None:
        first = next((r for r in records[:20] if isinstance(r, dict)), None)
        formatting = detect(first, source.columns, source.tags)
        if formatting is None:
            columns = ", ".join(map(str, first)) if first else "none readable"
            raise SftDataError(
                f"data.formatting: not set, and the records of {path} (columns: {columns}) match none of "
                "alpaca (instruction, input, output), sharegpt (conversations of from/value turns) or openai "
                f"(messages of role/content); set data.formatting ({', '.join(FORMATTINGS)}) and data.columns"
            )
    layout = make_layout(formatting, source.columns, source.tags)
    problems = layout_problems(layout, source.where)
    if problems:
        raise SftDataError("\n".join(problems))
    return layout


def converted_records(
    sources: Sequence[Source],
    max_samples: int | None,
    layout_of: Callable[[Source, str, Sequence[Any]], Any],
    convert: Callable[[Any, Any], Any],
    bad: list[BadRecord],
) -> Iterator[tuple[str, int, list[tuple[int, Any]]]]:
    """Each file of `sources` in training order: (path, records read, [(record index, converted)]).

    At most `max_samples` records of each source; a record that does not convert is added to `bad`.
    Raises FileProblem for a file that does not read (`reading` turns it into the caller's error).
    """
    for source in sources:
        left = max_samples
        for path in source.files:
            if left is not None and left <= 0:
                break
            records = read_records(path, file_format(path, source.fmt), left)
            left = None if left is None else left - len(records)
            layout = layout_of(source, path, records) if records else None
            converted: list[tuple[int, Any]] = []
            for i, record in enumerate(records):
                try:
                    if isinstance(record, RecordProblem):
                        raise record
                    assert layout is not None
                    converted.append((i, convert(record, layout)))
                except RecordProblem as e:
                    bad.append(BadRecord(path, i, e.field, e.reason))
            yield path, len(records), converted


def reading(files: Iterator[Any], error: type[Exception]) -> Iterator[Any]:
    """`files` (converted_records), a file that does not read raised as `error` ("data: ...")."""
    try:
        yield from files
    except FileProblem as e:
        raise error(f"data: {e}") from e


def build_sft_dataset(data: Any, pretrained: str | None = None) -> SftDataset:
    """The dataset of `data` (a DataConfig, source sft); raises SftDataError naming what is wrong."""
    sources, problems = sources_and_problems(data)
    tool_format = getattr(data, "tool_format", None)
    if tool_format is not None and tool_format not in TOOL_FORMATS:
        problems.append(
            f"data.tool_format: got {tool_format!r}; expected {' or '.join(TOOL_FORMATS)} (or null: the "
            "chat template renders tool calls and tools)"
        )
    if problems:
        raise SftDataError("\n".join(problems))
    try:
        tokenizer = chat_tokenizer(data, pretrained)
    except ValueError as e:
        raise SftDataError(str(e)) from e
    origin, facts = template_origin(data, pretrained), template_facts(tokenizer)
    report, seq_len = BuildReport(), int(data.seq_len)
    ids: list[int] = []
    labels: list[int] = []
    offsets, origins = [0], []
    files = converted_records(
        sources,
        data.max_samples,
        _layout,
        lambda record, layout: convert(record, layout, data.system),
        report.bad,
    )
    for path, read, convs in reading(files, SftDataError):
        report.records += read
        for start in range(0, len(convs), CHUNK):
            chunk = convs[start : start + CHUNK]
            names = [f"{path} record {i}" for i, _ in chunk]
            try:
                encoded = encode(tokenizer, [c for _, c in chunk], names, origin, tool_format, facts)
            except TemplateProblem as e:
                raise SftDataError(str(e)) from e
            for (i, _), enc in zip(chunk, encoded, strict=True):
                if isinstance(enc, RecordProblem):
                    report.bad.append(BadRecord(path, i, enc.field, enc.reason))
                    continue
                if enc.lost:
                    report.lost.append((path, i, enc.lost))
                    continue
                kept = kept_length(len(enc.ids), enc.answers, seq_len, data.mask_history)
                if kept is None:
                    report.overlong.append((path, i, enc.answers[0][0]))
                    continue
                ids += enc.ids[:kept]
                labels += labels_for(
                    enc.ids,
                    enc.answers,
                    train_on_prompt=data.train_on_prompt,
                    mask_history=data.mask_history,
                )[:kept]
                offsets.append(len(ids))
                origins.append((path, i))
    report.bad.sort(key=lambda b: (b.file, b.index))
    if report.lost:
        raise SftDataError(report.lost_message(origin, tool_format))
    if report.bad and data.on_bad_record != "skip":
        raise SftDataError(report.bad_message())
    if report.bad:
        log.warning(
            "data: skipped %d bad record(s) of %d (data.on_bad_record=skip)", len(report.bad), report.records
        )
    if report.overlong:
        log.warning(report.dropped_message(seq_len))
    if not origins:
        raise SftDataError(
            f"data: no trainable record among the {report.records} read"
            + (f"; {report.dropped_message(seq_len)}" if report.overlong else "")
        )
    return SftDataset(
        torch.tensor(ids, dtype=torch.int32),
        torch.tensor(labels, dtype=torch.int32),
        torch.tensor(offsets, dtype=torch.long),
        origins,
        pad_id(tokenizer),
        report,
    )
