"""Where a run's instruction records come from: `data.path`, or named datasets of a LLaMA-Factory
`dataset_info.json` (`data.dataset_dir` + `data.dataset`), trained on in the order named.

Only local files are read. Entries that download (hub URLs, loading scripts, cloud files) or hold
preference pairs (`ranking: true`) are refused with their reason, before any worker starts.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastictrain.data.sft.files import EXTENSIONS, FORMATS
from elastictrain.data.sft.records import COLUMN_KEYS, FORMATTINGS, TAG_KEYS

INFO_FILE = "dataset_info.json"
DOWNLOADS = {
    "hf_hub_url": "a Hugging Face Hub dataset",
    "ms_hub_url": "a ModelScope dataset",
    "om_hub_url": "a Modelers (openmind) dataset",
    "script_url": "a dataset loading script",
    "cloud_file_name": "a cloud file",
}
_UNSUPPORTED_COLUMNS = {
    "images": "images (multimodal data)",
    "videos": "videos (multimodal data)",
    "audios": "audios (multimodal data)",
    "chosen": "chosen (preference data)",
    "rejected": "rejected (preference data)",
    "kto_tag": "kto_tag (KTO preference data)",
}
_IGNORED_KEYS = {"file_sha1", "split"}  # LLaMA-Factory bookkeeping with no effect on local files
ENTRY_KEYS = {"file_name", "formatting", "ranking", "columns", "tags", *DOWNLOADS, *_IGNORED_KEYS}


@dataclass(frozen=True)
class Source:
    """One dataset: its files, read in order, and how its records are laid out."""

    name: str  # the dataset's name in dataset_info.json, or data.path
    files: tuple[str, ...]
    fmt: str | None = None  # data.format for every file; else each file's extension
    formatting: str | None = None  # None: detected from the records
    columns: Mapping[str, Any] = field(default_factory=dict)
    tags: Mapping[str, Any] = field(default_factory=dict)
    entry: bool = False  # named in dataset_info.json (else data.path)

    @property
    def where(self) -> str:
        """The config field its layout problems are reported under."""
        return f"data.dataset {self.name!r} ({INFO_FILE})" if self.entry else "data"


def dataset_names(value: Any) -> list[str]:
    """data.dataset as names: "a,b" or a list."""
    items = value.split(",") if isinstance(value, str) else list(value or [])
    return [str(x).strip() for x in items if str(x).strip()]


def mapping_problems(prefix: str, columns: Any, tags: Any) -> list[str]:
    """Column and tag renames: known keys, text values (`prefix`: 'data.' or the dataset's entry)."""
    p = []
    for part, value, known in (("columns", columns, COLUMN_KEYS), ("tags", tags, TAG_KEYS)):
        if value is None:
            continue
        if not isinstance(value, Mapping):
            p.append(f"{prefix}{part}: got {value!r}; expected a mapping of {', '.join(known)}")
            continue
        for key, name in value.items():
            if part == "columns" and key in _UNSUPPORTED_COLUMNS:
                p.append(
                    f"{prefix}{part}.{key}: {_UNSUPPORTED_COLUMNS[key]} is not supported; supervised "
                    "fine-tuning reads text conversations with one answer per prompt"
                )
            elif key not in known:
                p.append(f"{prefix}{part}.{key}: unknown; expected one of {', '.join(known)}")
            elif name is not None and not isinstance(name, str):
                p.append(f"{prefix}{part}.{key}: got {name!r}; expected a column name")
    return p


def extension_problems(files: list[str], fmt: str | None) -> list[str]:
    unknown = [f for f in files if fmt is None and Path(f).suffix.lower() not in EXTENSIONS]
    if not unknown:
        return []
    return [
        f"data.format: missing and {unknown[0]} has no instruction-record extension "
        f"({', '.join(EXTENSIONS)}); expected one of {', '.join(FORMATS)}"
    ]


def files_of(target: Path) -> list[str]:
    if target.is_dir():
        return sorted(str(f) for f in target.iterdir() if f.is_file() and f.suffix.lower() in EXTENSIONS)
    return [str(target)] if target.is_file() else []


def read_info(dataset_dir: str) -> tuple[dict[str, Any] | None, str | None]:
    """(the parsed dataset_info.json, None) or (None, the problem)."""
    path = Path(dataset_dir) / INFO_FILE
    if not Path(dataset_dir).is_dir():
        return None, f"data.dataset_dir: got {dataset_dir!r}; expected an existing folder holding {INFO_FILE}"
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, f"data.dataset_dir: {path} does not exist; expected LLaMA-Factory's {INFO_FILE} there"
    except (OSError, ValueError) as e:
        return None, f"data.dataset_dir: {path} does not read as JSON ({e})"
    if not isinstance(info, dict):
        return (
            None,
            f"data.dataset_dir: {path} holds {type(info).__name__}; expected a mapping of dataset names",
        )
    return info, None


def download_problems(where: str, entry: Mapping[str, Any]) -> list[str]:
    """An entry that names a download (a hub dataset, a script, a cloud file): refused, naming it."""
    return [
        f"{where}: {key} {entry[key]!r} is {what}; elastictrain reads local files only: download it into "
        "data.dataset_dir and give its file_name"
        for key, what in DOWNLOADS.items()
        if entry.get(key)
    ]


def entry_files(where: str, entry: Mapping[str, Any], dataset_dir: str, problems: list[str]) -> list[str]:
    """The files an entry's file_name names inside `dataset_dir` (none for a download); what is wrong
    with it is added to `problems`."""
    if any(entry.get(k) for k in DOWNLOADS):
        return []
    file_name = entry.get("file_name")
    if not isinstance(file_name, str) or not file_name:
        problems.append(f"{where}: file_name missing; expected a file or folder inside {dataset_dir}")
        return []
    files = files_of(Path(dataset_dir) / file_name)
    problems.extend(extension_problems(files, None))
    if not files:
        problems.append(
            f"{where}: file_name {file_name!r} is no file (nor a folder of {', '.join(EXTENSIONS)} files) "
            f"in {dataset_dir}"
        )
    return files


def entry_source(name: str, entry: Any, dataset_dir: str) -> tuple[Source | None, list[str]]:
    """One dataset_info.json entry as a Source, or the reasons it is refused."""
    where = f"data.dataset: {name!r} ({Path(dataset_dir) / INFO_FILE})"
    if not isinstance(entry, Mapping):
        return None, [f"{where}: got {entry!r}; expected a mapping with file_name"]
    p = download_problems(where, entry)
    if entry.get("ranking"):
        p.append(
            f"{where}: ranking: true is a preference dataset (chosen and rejected answers, for DPO or reward "
            "models); supervised fine-tuning needs one answer per prompt. Train pairs with "
            "training.objective=dpo (or orpo, simpo)"
        )
    for key in entry:
        if key not in ENTRY_KEYS:
            p.append(f"{where}: key {key!r} is not supported; expected only {', '.join(sorted(ENTRY_KEYS))}")
    formatting = entry.get("formatting")
    if formatting is not None and formatting not in FORMATTINGS:
        p.append(f"{where}: formatting {formatting!r}; expected one of {', '.join(FORMATTINGS)}")
    p.extend(mapping_problems(f"{where}: ", entry.get("columns"), entry.get("tags")))
    files = entry_files(where, entry, dataset_dir, p)
    if p:
        return None, p
    columns, tags = entry.get("columns") or {}, entry.get("tags") or {}
    source = Source(name, tuple(files), None, formatting, columns, tags, entry=True)
    return source, []


def sources_and_problems(data: Any) -> tuple[list[Source], list[str]]:
    """The datasets of `data` (a DataConfig with source sft) in training order, and what is wrong."""
    p: list[str] = []
    if data.format is not None and data.format not in FORMATS:
        p.append(
            f"data.format: got {data.format!r}; expected one of {', '.join(FORMATS)} for data.source sft"
        )
    if data.dataset_dir or data.dataset:
        if data.path:
            p.append(
                f"data.path: got {data.path!r} and data.dataset {data.dataset!r}; expected one of them "
                "(a file, or named datasets of data.dataset_dir's dataset_info.json)"
            )
        names = dataset_names(data.dataset)
        if not data.dataset_dir or not names:
            missing = "data.dataset_dir" if not data.dataset_dir else "data.dataset"
            return [], [
                *p,
                f"{missing}: missing; expected data.dataset_dir=DIR and data.dataset=name1,name2 together",
            ]
        info, problem = read_info(data.dataset_dir)
        if info is None:
            return [], [*p, str(problem)]
        out = []
        for name in names:
            if name not in info:
                known = ", ".join(sorted(info)) or "none"
                p.append(
                    f"data.dataset: {name!r} is not in {Path(data.dataset_dir) / INFO_FILE} (it has: {known})"
                )
                continue
            source, problems = entry_source(name, info[name], data.dataset_dir)
            p.extend(problems)
            out += [source] if source else []
        return out, p
    if not data.path:
        return [], [
            *p,
            "data.path: missing; expected local instruction records (json, jsonl, csv, parquet), or "
            "data.dataset_dir and data.dataset",
        ]
    files = sorted(glob.glob(data.path))
    if not files:
        p.append(f"data.path: got {data.path!r}; no file matches it")
    if data.formatting is not None and data.formatting not in FORMATTINGS:
        p.append(
            f"data.formatting: got {data.formatting!r}; expected one of {', '.join(FORMATTINGS)} "
            "(or null: detected from the records)"
        )
    p.extend(mapping_problems("data.", data.columns, data.tags))
    p.extend(extension_problems(files, data.format))
    source = Source(
        data.path, tuple(files), data.format, data.formatting, data.columns or {}, data.tags or {}
    )
    return [source], p
