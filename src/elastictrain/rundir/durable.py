"""Durable file writes: data and directory entries fsynced, replacement by rename.

`crash_point` lets a test kill the process (SIGKILL, as the OOM killer or a node loss would) at a
named point of a save, to prove that no such point leaves a checkpoint that loads as complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from elastictrain.rundir.liveness import pid_exists

CRASH_ENV = "ELASTICTRAIN_CRASH_AT"
_passed: Counter[str] = Counter()


def crash_point(phase: str) -> None:
    """SIGKILL this process at `phase` when ELASTICTRAIN_CRASH_AT names it ("phase" or "phase@N").

    "phase@N" fires the N-th time this process passes the phase (e.g. the second checkpoint's save).
    Unset (the normal case) it costs one environment lookup.
    """
    wanted = os.environ.get(CRASH_ENV)
    if not wanted:
        return
    name, _, nth = wanted.partition("@")
    if name != phase:
        return
    _passed[phase] += 1
    if _passed[phase] >= int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)


def _phase_of(path: Path) -> str | None:
    # The crash points of the files a checkpoint is made of: rank shards and the manifest.
    if path.suffix == ".safetensors":
        return "shard"
    if path.name == "manifest.json":
        return "manifest"
    return None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_durably(path: Path, data: bytes | memoryview) -> str:
    """Write, fsync, and return the sha256 of what was written (see `write_chunks_durably`)."""
    return write_chunks_durably(path, [data], len(data))[1]


def write_chunks_durably(
    path: Path, chunks: Iterable[Any], total: int | None = None, block: int = 64 << 20
) -> tuple[int, str]:
    """Write `chunks` (buffers: bytes, arrays; `total` bytes in all where known) in order, fsync, and
    return (bytes written, sha256).

    Chunks are written as they come, in pieces of at most `block` bytes, so a caller may stream a
    file far larger than the memory it holds at once. A failed write (ENOSPC, EIO) removes the torn
    file before re-raising, so a full disk never leaves a half-written file behind that could be
    mistaken for a whole one.
    """
    h = hashlib.sha256()
    phase = _phase_of(Path(path))
    # Where a crash test tears the file: half way, or after the first chunk when the size is not known.
    torn_at = -1
    if phase is not None and os.environ.get(CRASH_ENV):
        torn_at = total // 2 if total else 1
    written = 0
    try:
        with open(path, "wb", buffering=0) as f:
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                for lo in range(0, len(view), block):
                    piece = view[lo : lo + block]
                    if written <= torn_at < written + len(piece):
                        cut = torn_at - written
                        _write_all(f, piece[:cut])
                        os.fsync(f.fileno())
                        crash_point(f"{phase}_partial")  # killed mid-write: a torn file on disk
                        _write_all(f, piece[cut:])
                    else:
                        _write_all(f, piece)
                    h.update(piece)
                    written += len(piece)
            os.fsync(f.fileno())
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    if total is not None and written != total:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise RuntimeError(f"{path}: wrote {written} bytes, expected {total}")
    if phase is not None:
        crash_point(f"{phase}_written")
    return written, h.hexdigest()


def _write_all(f: Any, view: memoryview) -> None:
    while len(view):
        n = f.write(view)
        view = view[n:]


def replace_text_atomically(path: Path, text: str) -> None:
    """Readers see the old content or the new one, never a torn file, even across a crash."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write_bytes_durably(tmp, text.encode("utf-8"))
    crash_point(f"{path.name}_tmp_written")
    os.replace(tmp, path)
    fsync_dir(path.parent)


def remove_stale_temporaries(folder: Path, max_age_s: float = 3600.0) -> list[str]:
    """Remove the `.NAME.tmp-PID` files of replace_text_atomically that a crash left in `folder`.

    Not this process's, and only when that pid is gone on this host or the file is old (a pid seen
    from another node means nothing here).
    """
    removed = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return []
    for path in entries:
        match = _TMP.fullmatch(path.name)
        if not match or int(match.group(1)) == os.getpid():
            continue
        try:
            old = time.time() - path.stat().st_mtime > max_age_s
            if old or not pid_exists(int(match.group(1))):
                path.unlink()
                removed.append(path.name)
        except OSError:
            continue
    return removed


_TMP = re.compile(r"\..+\.tmp-(\d+)")


def sha256_of_file(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
