"""Where preference records come from: `data.path` (TRL's shapes, or LLaMA-Factory's, detected), or
named entries of a LLaMA-Factory `dataset_info.json` that hold pairs (`ranking: true`) or KTO examples
(`columns.kto_tag`). The sft reader (data/sft/dataset_info.py) keeps refusing those entries for
supervised fine-tuning; this reader accepts them and refuses the rest, reusing its file helpers.
"""

from __future__ import annotations

import glob
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from elastictrain.data.preference.records import PAIR_FORMATTINGS
from elastictrain.data.sft.dataset_info import (
    ENTRY_KEYS,
    INFO_FILE,
    Source,
    dataset_names,
    download_problems,
    entry_files,
    extension_problems,
    read_info,
)
from elastictrain.data.sft.records import COLUMN_KEYS, TAG_KEYS

PREFERENCE_COLUMNS = ("chosen", "rejected", "kto_tag")
FORMATTINGS = (*PAIR_FORMATTINGS, "openai")  # openai: sharegpt's layout with role/content turns


def is_kto(source: Source) -> bool:
    """A source of KTO examples (a kto_tag column) rather than pairs."""
    return bool(source.columns.get("kto_tag"))


def _mapping_problems(where: str, columns: Any, tags: Any) -> list[str]:
    p = []
    known_columns = (*COLUMN_KEYS, *PREFERENCE_COLUMNS)
    for part, value, known in (("columns", columns, known_columns), ("tags", tags, TAG_KEYS)):
        if value is None:
            continue
        if not isinstance(value, Mapping):
            p.append(f"{where}{part}: got {value!r}; expected a mapping of {', '.join(known)}")
            continue
        for key, name in value.items():
            if key not in known:
                p.append(f"{where}{part}.{key}: unknown; expected one of {', '.join(known)}")
            elif name is not None and not isinstance(name, str):
                p.append(f"{where}{part}.{key}: got {name!r}; expected a column name")
    return p


def preference_entry(name: str, entry: Any, dataset_dir: str) -> tuple[Source | None, list[str]]:
    """One dataset_info.json entry holding pairs or KTO examples, or the reasons it is refused."""
    where = f"data.dataset: {name!r} ({Path(dataset_dir) / INFO_FILE})"
    if not isinstance(entry, Mapping):
        return None, [f"{where}: got {entry!r}; expected a mapping with file_name"]
    p = download_problems(where, entry)
    p += [f"{where}: key {k!r} is not supported" for k in entry if k not in ENTRY_KEYS]
    columns, tags = entry.get("columns") or {}, entry.get("tags") or {}
    p.extend(_mapping_problems(f"{where}: ", entry.get("columns"), entry.get("tags")))
    kto = isinstance(columns, Mapping) and bool(columns.get("kto_tag"))
    if not entry.get("ranking") and not kto:
        p.append(
            f"{where}: not preference data; expected ranking: true (chosen and rejected answers) or "
            "columns.kto_tag (KTO examples)"
        )
    formatting = entry.get("formatting", "alpaca")  # LLaMA-Factory's default
    if formatting not in FORMATTINGS or formatting == "trl":
        p.append(f"{where}: formatting {formatting!r}; expected alpaca, sharegpt or openai")
    files = entry_files(where, entry, dataset_dir, p)
    if p:
        return None, p
    return Source(name, tuple(files), None, formatting, dict(columns), dict(tags), entry=True), []


def preference_sources(data: Any) -> tuple[list[Source], list[str]]:
    """The preference datasets of `data` in training order, and what is wrong."""
    if data.dataset_dir or data.dataset:
        names = dataset_names(data.dataset)
        if not data.dataset_dir or not names:
            missing = "data.dataset_dir" if not data.dataset_dir else "data.dataset"
            return [], [
                f"{missing}: missing; expected data.dataset_dir=DIR and data.dataset=name1,name2 together"
            ]
        info, problem = read_info(data.dataset_dir)
        if info is None:
            return [], [str(problem)]
        out, p = [], []
        for name in names:
            if name not in info:
                p.append(f"data.dataset: {name!r} is not in {Path(data.dataset_dir) / INFO_FILE}")
                continue
            source, problems = preference_entry(name, info[name], data.dataset_dir)
            p.extend(problems)
            out += [source] if source else []
        return out, p
    if not data.path:
        return [], [
            "data.path: missing; expected local preference records, or data.dataset_dir and data.dataset"
        ]
    files = sorted(glob.glob(data.path))
    p = [] if files else [f"data.path: got {data.path!r}; no file matches it"]
    formatting = getattr(data, "formatting", None)
    if formatting is not None and formatting not in FORMATTINGS:
        p.append(f"data.formatting: got {formatting!r}; expected one of {', '.join(FORMATTINGS)} (or null)")
    p.extend(_mapping_problems("data.", data.columns, data.tags))
    p.extend(extension_problems(files, data.format))
    columns, tags = dict(data.columns or {}), dict(data.tags or {})
    return [Source(data.path, tuple(files), data.format, formatting, columns, tags)], p
