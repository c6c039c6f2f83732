"""`data.source: tokens`: the shard folder's index, and the checks made of it at every start.

The layout nanoGPT and many pre-training pipelines write: flat arrays of token ids, `uint16` or
`uint32`, in `.bin` files (raw) or `.npy` files (with a header). The shards, in name order, are one
stream of tokens; sample i is tokens [i*seq_len, (i+1)*seq_len) of that stream, so a sample may span
two shards. Nothing is read whole into memory: each shard is an `np.memmap` and a sample reads only its
bytes.

`index.json` in the folder lists the shards (name, tokens, bytes), the dtype, the total and, when
`elastictrain prepare-data` wrote it, the tokenizer and its vocabulary size; a sha256 of its own content
(`checksum`) catches an edited or damaged index. It is built once (by prepare-data, or at the first
start for shards written elsewhere) and checked against the files at every start, on the driver
before any actor starts (`index_problems`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

INDEX = "index.json"
FORMAT = "elastictrain-tokens/1"
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
SUFFIXES = (".bin", ".npy")


def index_checksum(index: dict[str, Any]) -> str:
    body = {k: v for k, v in index.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def shard_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix in SUFFIXES and p.is_file())


def open_shard(path: Path, dtype: str) -> np.ndarray:
    """A read-only memory map of one shard (a .npy file's header says its own dtype)."""
    if path.suffix == ".npy":
        return np.load(path, mmap_mode="r")
    return np.memmap(path, dtype=DTYPES[dtype], mode="r")


def build_index(folder: Path, dtype: str, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """The index of the shards now in `folder` (sizes read from the files, nothing else)."""
    shards = []
    for path in shard_files(folder):
        size = path.stat().st_size
        if path.suffix == ".npy":
            arr = np.load(path, mmap_mode="r")
            tokens = int(arr.size)
        else:
            tokens = size // np.dtype(DTYPES[dtype]).itemsize
        shards.append({"name": path.name, "tokens": tokens, "bytes": size})
    index: dict[str, Any] = {
        "format": FORMAT,
        "dtype": dtype,
        "tokens": sum(s["tokens"] for s in shards),
        "shards": shards,
        **(meta or {}),
    }
    index["checksum"] = index_checksum(index)
    return index


def write_index(folder: Path, index: dict[str, Any]) -> None:
    tmp = folder / f".{INDEX}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(index, indent=1) + "\n")
    os.replace(tmp, folder / INDEX)


def load_index(folder: Path, dtype: str | None) -> dict[str, Any]:
    """index.json, built (and written when the folder allows) the first time shards are used."""
    path = folder / INDEX
    if path.is_file():
        index: dict[str, Any] = json.loads(path.read_text())
        return index
    index = build_index(folder, dtype or "uint16")
    with contextlib.suppress(OSError):  # a read-only folder: rebuilt (from sizes only) at each start
        write_index(folder, index)
    return index


def index_problems(folder_name: str | None, dtype: str | None, field: str = "data.path") -> list[str]:
    """What is wrong with a shard folder, one line each, naming the field and the file."""
    if not folder_name:
        return [f"{field}: missing; expected a folder of token shards when data.source is 'tokens'"]
    folder = Path(folder_name)
    if not folder.is_dir():
        return [f"{field}: got {folder_name!r}; expected a folder of token shards (.bin or .npy)"]
    files = shard_files(folder)
    if not files:
        return [
            f"{field}: {folder_name!r} holds no .bin or .npy shard; "
            "write some with `elastictrain prepare-data`"
        ]
    if dtype is not None and dtype not in DTYPES:
        return [f"data.dtype: got {dtype!r}; expected uint16 or uint32"]
    try:
        index = load_index(folder, dtype)
    except (OSError, ValueError) as e:
        return [
            f"{field}: {folder / INDEX} does not read as JSON ({e}); delete it to rebuild it from the shards"
        ]
    rebuild = f"delete {folder / INDEX} to rebuild it if the shards are right"
    if index.get("checksum") != index_checksum(index):
        return [f"{field}: {folder / INDEX} does not match its checksum (edited or damaged); {rebuild}"]
    if dtype is not None and index.get("dtype") != dtype:
        return [f"data.dtype: got {dtype}; {folder / INDEX} says the shards are {index.get('dtype')}"]
    p: list[str] = []
    listed = {s["name"]: s for s in index.get("shards", [])}
    for name, entry in listed.items():
        path = folder / name
        if not path.is_file():
            p.append(f"{field}: shard {path} is in {INDEX} but missing")
            continue
        size = path.stat().st_size
        if size != entry["bytes"]:
            p.append(
                f"{field}: shard {path} is {size} bytes, {INDEX} says {entry['bytes']} bytes "
                f"({entry['tokens']} tokens): truncated or rewritten; restore it, or {rebuild}"
            )
        elif path.suffix == ".bin" and size % np.dtype(DTYPES[index["dtype"]]).itemsize:
            p.append(f"{field}: shard {path} is {size} bytes, not a whole number of {index['dtype']} tokens")
    extra = [f.name for f in files if f.name not in listed]
    if extra:
        p.append(f"{field}: shard(s) {', '.join(extra)} in {folder_name} are not in {INDEX}; {rebuild}")
    return p


def vocab_of(folder_name: str) -> int | None:
    """The vocabulary size prepare-data recorded for a shard folder, if any."""
    path = Path(folder_name) / INDEX
    try:
        value = json.loads(path.read_text()).get("vocab_size")
    except (OSError, ValueError):
        return None
    return int(value) if isinstance(value, int) else None
