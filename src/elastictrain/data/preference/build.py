"""Preference data built from a DataConfig: every record read, converted (records.py), encoded through
the chat template (encode.py) and cut at data.seq_len, in order (datasets as named, files sorted,
records as in each file), the same on every worker.

Bad records are named with file, index and field as the sft build names them (its BadRecord), and fail
the build unless data.on_bad_record is skip. Pairs (or KTO examples) whose answer keeps no token after
the cut are dropped and counted in the report, never trained with no target.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from elastictrain.data.preference.encode import EncodedKto, EncodedPair, cut, cut_kto, encode_many
from elastictrain.data.preference.records import detect_pairs, pair_layout, to_kto, to_pair
from elastictrain.data.preference.sources import is_kto, preference_sources
from elastictrain.data.sft.dataset import CHUNK, SHOWN, BadRecord, converted_records, reading
from elastictrain.data.sft.dataset_info import Source
from elastictrain.data.sft.records import Layout, RecordProblem, detect, make_layout
from elastictrain.data.sft.render import TemplateProblem, chat_tokenizer, pad_id, template_origin

log = logging.getLogger("elastictrain.data")


class PreferenceDataError(ValueError):
    """Preference data that cannot train; the message names the field, the files and records."""


@dataclass
class PreferenceReport:
    """What a build read, kept and left out."""

    records: int = 0
    bad: list[BadRecord] = field(default_factory=list)
    dropped: list[tuple[str, int, int]] = field(default_factory=list)  # (file, record, prompt tokens)
    origins: list[tuple[str, int]] = field(default_factory=list)  # of each kept example, in order
    pad_token_id: int = 0  # the tokenizer's pad id (else its end of sequence): what rows are padded with

    def bad_message(self) -> str:
        shown = "\n".join(f"  {b.line()}" for b in self.bad[:SHOWN])
        more = f"\n  ... and {len(self.bad) - SHOWN} more" if len(self.bad) > SHOWN else ""
        return (
            f"data: {len(self.bad)} of {self.records} preference records are bad:\n{shown}{more}\n"
            "Fix them, or set data.on_bad_record=skip to train without them"
        )

    def dropped_message(self, seq_len: int) -> str:
        where = "; ".join(f"{f} record {i}: a prompt of {n} tokens" for f, i, n in self.dropped[:3])
        more = "; ..." if len(self.dropped) > 3 else ""
        return (
            f"data: {len(self.dropped)} record(s) dropped: an answer keeps no token in "
            f"data.seq_len={seq_len} after the prompt ({where}{more}); raise data.seq_len to keep them"
        )


def _layout(source: Source, path: str, records: Sequence[Any], kto: bool) -> Layout:
    first = next((r for r in records[:20] if isinstance(r, dict)), None)
    formatting = source.formatting
    if formatting is None and kto:
        trl = isinstance(first, dict) and "completion" in first and "label" in first
        formatting = "trl" if trl else detect(first, source.columns, source.tags)
    elif formatting is None:
        formatting = detect_pairs(first)
    if formatting is None:
        columns = ", ".join(map(str, first)) if first else "none readable"
        raise PreferenceDataError(
            f"data.formatting: not set, and the records of {path} (columns: {columns}) are no preference "
            "records: expected chosen and rejected (with instruction, conversations or prompt), TRL's "
            "prompt/completion/label, or an sft record with columns.kto_tag"
        )
    if kto:
        return (
            Layout("trl", {}) if formatting == "trl" else make_layout(formatting, source.columns, source.tags)
        )
    layout = pair_layout(formatting, source.columns, source.tags)
    missing = [k for k in ("chosen", "rejected") if formatting != "trl" and not layout.columns.get(k)]
    if missing:
        raise PreferenceDataError(
            f"{source.where}.columns.{missing[0]}: missing; a columns mapping names every column read, so "
            "give chosen and rejected too"
        )
    return layout


def _build(data: Any, pretrained: str | None, kto: bool) -> tuple[list[Any], PreferenceReport]:
    sources, problems = preference_sources(data)
    wrong = [s.name for s in sources if s.entry and is_kto(s) != kto]  # data.path: told by records
    if wrong and not problems:
        want, got = ("KTO examples", "pairs") if kto else ("pairs", "KTO examples (columns.kto_tag)")
        problems.append(f"data.dataset: {', '.join(map(repr, wrong))} hold {got}; expected {want}")
    if problems:
        raise PreferenceDataError("\n".join(problems))
    try:
        tokenizer = chat_tokenizer(data, pretrained)
    except ValueError as e:
        raise PreferenceDataError(str(e)) from e
    origin, seq_len, report = template_origin(data, pretrained), int(data.seq_len), PreferenceReport()
    report.pad_token_id = pad_id(tokenizer)
    system = getattr(data, "system", None)
    convert: Callable[[Any, Layout], Any] = (
        (lambda r, lay: to_kto(r, lay, system)) if kto else (lambda r, lay: to_pair(r, lay, system))
    )
    trim: Callable[[Any, int], Any] = cut_kto if kto else cut
    out: list[Any] = []
    layout_of = functools.partial(_layout, kto=kto)
    files = converted_records(sources, getattr(data, "max_samples", None), layout_of, convert, report.bad)
    for path, read, items in reading(files, PreferenceDataError):
        report.records += read
        for start in range(0, len(items), CHUNK):
            chunk = items[start : start + CHUNK]
            names = [f"{path} record {i}" for i, _ in chunk]
            try:
                encoded = encode_many(tokenizer, [x for _, x in chunk], names, origin)
            except TemplateProblem as e:
                raise PreferenceDataError(str(e)) from e
            for (i, _), enc in zip(chunk, encoded, strict=True):
                if isinstance(enc, RecordProblem):
                    report.bad.append(BadRecord(path, i, enc.field, enc.reason))
                    continue
                kept = trim(enc, seq_len)
                if kept is None:
                    report.dropped.append((path, i, len(enc.prompt_ids)))
                    continue
                out.append(kept)
                report.origins.append((path, i))
    report.bad.sort(key=lambda b: (b.file, b.index))
    if report.bad and getattr(data, "on_bad_record", "error") != "skip":
        raise PreferenceDataError(report.bad_message())
    if report.bad:
        log.warning("data: skipped %d bad preference record(s) of %d", len(report.bad), report.records)
    if report.dropped:
        log.warning(report.dropped_message(seq_len))
    if not out:
        raise PreferenceDataError(
            f"data: no trainable preference record among the {report.records} read"
            + (f"; {report.dropped_message(seq_len)}" if report.dropped else "")
        )
    return out, report


def build_pairs(data: Any, pretrained: str | None = None) -> tuple[list[EncodedPair], PreferenceReport]:
    """The cut, encoded pairs of `data` (ranking: true entries, or data.path files) and the report."""
    return _build(data, pretrained, kto=False)


def build_kto(data: Any, pretrained: str | None = None) -> tuple[list[EncodedKto], PreferenceReport]:
    """The cut, encoded KTO examples of `data` (entries with columns.kto_tag, or TRL's unpaired files)."""
    return _build(data, pretrained, kto=True)
