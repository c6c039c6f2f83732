"""Offline resharding: rewrite a checkpoint's fragments as a world size M's ZeRO-3 partitions.

Training never needs this (any world size loads any checkpoint by reading its own slices), but a
checkpoint laid out for M ranks lets each rank of an M-rank job read exactly one file, and is what
`elastictrain reshard` produces for other tools.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from elastictrain.checkpoint.store import FORMAT, MANIFEST
from elastictrain.storage.durable import fsync_dir, write_bytes_durably


def _replaceable(out: Path, source: Any) -> str | None:
    """Why `out` must not be replaced by a resharded checkpoint (None: it may be)."""
    if out.is_file() or (out.exists() and not out.is_dir()):
        return f"--out: {out} is a file; expected a folder (new, empty, or an earlier output of reshard)"
    if not out.is_dir() or not any(out.iterdir()):
        return None
    if isinstance(source, Path) and (
        out.resolve() == source.resolve() or source.resolve().is_relative_to(out.resolve())
    ):
        return f"--out: {out} holds the checkpoint being resharded; give another folder"
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        manifest = None
    if not (isinstance(manifest, dict) and manifest.get("format") == FORMAT and "resharded_from" in manifest):
        return (
            f"--out: {out} is a non-empty folder that is not a resharded checkpoint; it is kept as it is. "
            "Expected a new or empty folder, or an earlier output of `elastictrain reshard` (replaced)"
        )
    return None


def _check_world_size(world_size: int, params: dict[str, Any]) -> None:
    largest = max(params, key=lambda n: params[n].numel, default=None)
    most = params[largest].numel if largest is not None else 1
    if not 1 <= world_size <= most:
        raise ValueError(
            f"--world-size: got {world_size}; expected 1 to {most} (the largest parameter, {largest}, has "
            f"{most} elements; every rank beyond that would hold nothing)"
        )


def reshard_checkpoint(checkpoint: Any, world_size: int, out: Path | None = None) -> Path:
    from elastictrain.checkpoint.zero_state import FragmentReader

    if world_size < 1:
        raise ValueError(f"--world-size: got {world_size}; expected an integer >= 1")
    out = out or checkpoint.with_name(f"{checkpoint.name}.ws{world_size}")
    if not isinstance(out, Path):
        raise ValueError(
            f"--out: {out} is on an object store; reshard writes a local folder: give --out PATH"
        )
    refusal = _replaceable(out, checkpoint)
    if refusal:
        raise ValueError(refusal)
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    files = [checkpoint / f["name"] for f in manifest["files"] if f["name"].endswith(".safetensors")]
    reader = FragmentReader(files)
    _check_world_size(world_size, reader.params)
    staging = out.with_name(f".staging-{out.name}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    entries = [_write_rank(reader, rank, world_size, staging) for rank in range(world_size)]
    new_manifest = {**manifest, "world_size": world_size, "files": entries, "resharded_from": str(checkpoint)}
    write_bytes_durably(staging / MANIFEST, json.dumps(new_manifest, indent=1).encode())
    fsync_dir(staging)  # its entries are durable before the rename publishes it
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    fsync_dir(out.parent)
    return out


def _write_rank(reader: Any, rank: int, world_size: int, staging: Path) -> dict[str, Any]:
    """Rank `rank`'s file, streamed fragment by fragment: the memory used is one fragment's, not the
    file's (gigabytes at 1B, and twice that once serialized)."""
    from elastictrain.checkpoint.rank_snapshot import RankFilePlan
    from elastictrain.checkpoint.writer import ShardWrite
    from elastictrain.checkpoint.zero_state import Fragment, rank_file

    plan = RankFilePlan(fields=[])
    fragments: dict[str, Any] = {}
    reads: list[tuple[str, str, int, int]] = []
    for name, whole in reader.params.items():
        part = math.ceil(whole.numel / world_size)  # ZeRO-3's partition size for this parameter
        start = rank * part
        length = max(0, min(part, whole.numel - start))
        if length == 0:
            continue
        for field in reader.fields(name):
            plan.keys[f"{name}::{field}"] = (plan.numel, length)
            plan.numel += length
            reads.append((name, field, start, length))
        fragments[name] = Fragment(start, length, whole.numel, whole.shape)
    file_name, metadata = rank_file(rank, world_size, fragments)
    header = plan.header(metadata)

    def chunks() -> Iterator[Any]:
        yield header
        for name, field, start, length in reads:
            yield memoryview(reader.read(name, field, start, length).numpy()).cast("B")

    write = ShardWrite(staging / file_name, chunks, total=len(header) + plan.data_bytes)
    write.run()
    if write.error or write.file is None:
        raise RuntimeError(f"writing {staging / file_name}: {write.error}")
    return write.file
