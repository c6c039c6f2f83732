"""Instruction records from local files: JSON (a list of records, or one per line), JSON lines, CSV, Parquet.

Records are read as the file holds them, one Python value each, in file order: a record of an odd
shape stays a record (named by its index when it does not convert) instead of failing a whole
table's schema, and CSV cells stay the exact text of the file (list columns as JSON text).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from elastictrain.data.sft.records import RecordProblem

EXTENSIONS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
FORMATS = ("json", "csv", "parquet")


class FileProblem(ValueError):
    """A data file that cannot be read at all (the message names it)."""


def file_format(path: str | Path, given: str | None = None) -> str:
    fmt = given or EXTENSIONS.get(Path(path).suffix.lower())
    if fmt not in FORMATS:
        known = ", ".join(EXTENSIONS)
        raise FileProblem(
            f"{path}: no instruction-record format for it ({known}); expected one of {', '.join(FORMATS)}"
        )
    return fmt


def read_records(path: str | Path, fmt: str, limit: int | None = None) -> list[Any]:
    """The first `limit` records (all when None); an unreadable JSON line is a RecordProblem in its place."""
    path = Path(path)
    try:
        if fmt == "json":
            records = _json(path, limit)
        elif fmt == "csv":
            records = _csv(path, limit)
        else:
            records = _parquet(path, limit)
    except FileProblem:
        raise
    except (OSError, UnicodeDecodeError, csv.Error, ValueError) as e:
        raise FileProblem(f"{path}: does not read as {fmt}: {e}") from e
    return records[:limit] if limit is not None else records


def _json(path: Path, limit: int | None) -> list[Any]:
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):  # a list of records; anything else is read as JSON lines
        try:
            return list(json.loads(text))
        except json.JSONDecodeError as e:
            raise FileProblem(
                f"{path}: not valid JSON ({e}); expected a list of records or one per line"
            ) from None
    out: list[Any] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            out.append(RecordProblem(f"line {number}", f"not valid JSON ({e.msg})"))
        if limit is not None and len(out) >= limit:
            break
    return out


def _csv(path: Path, limit: int | None) -> list[Any]:
    with path.open(newline="", encoding="utf-8") as f:
        out = []
        for row in csv.DictReader(f):
            out.append(dict(row))
            if limit is not None and len(out) >= limit:
                break
        return out


def _parquet(path: Path, limit: int | None) -> list[Any]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    if limit is not None:
        table = table.slice(0, limit)
    return table.to_pylist()
