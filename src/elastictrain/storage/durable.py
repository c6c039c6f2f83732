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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

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


def phase_of(path: Any) -> str | None:
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


class HashingStream:
    """Bytes written to `raw`, counted and hashed on the way; the first write of a checkpoint file
    may stop half-way at its `_partial` crash point (killed mid-write: a torn file)."""

    def __init__(self, raw: IO[bytes], phase: str | None, sync: Callable[[], None]) -> None:
        self._raw = raw
        self._phase = phase if os.environ.get(CRASH_ENV) else None
        self._sync = sync
        self._hash = hashlib.sha256()
        self.size = 0
        self.sha256 = ""

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        if self._phase is not None and self.size == 0:
            half = len(view) // 2
            self._raw.write(view[:half])
            self._sync()
            crash_point(f"{self._phase}_partial")
            self._raw.write(view[half:])
        else:
            self._raw.write(view)
        self._hash.update(view)
        self.size += len(view)
        return len(view)

    def finish(self) -> None:
        self.sha256 = self._hash.hexdigest()


@contextlib.contextmanager
def create_durably(path: Path) -> Iterator[HashingStream]:
    """A file written through the yielded stream, then fsynced; its size and sha256 on the stream.

    A failed write (ENOSPC, EIO, or any error of the writer) removes the torn file before re-raising,
    so a full disk never leaves a half-written file behind that could be mistaken for a whole one.
    """
    phase = phase_of(Path(path))
    try:
        with open(path, "wb") as f:

            def sync() -> None:
                f.flush()
                os.fsync(f.fileno())

            stream = HashingStream(f, phase, sync)
            yield stream
            sync()
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    stream.finish()
    if phase is not None:
        crash_point(f"{phase}_written")


def write_bytes_durably(path: Path, data: bytes | memoryview) -> str:
    """Write, fsync, and return the sha256 of what was written (no torn file on failure)."""
    with create_durably(path) as stream:
        stream.write(data)
    return stream.sha256


def replace_text_atomically(path: Path, text: str) -> None:
    """Readers see the old content or the new one, never a torn file, even across a crash."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write_bytes_durably(tmp, text.encode("utf-8"))
    crash_point(f"{path.name}_tmp_written")
    os.replace(tmp, path)
    fsync_dir(path.parent)


def remove_stale_temporaries(folder: Any, max_age_s: float = 3600.0) -> list[str]:
    """Remove the `.NAME.tmp-PID` files of replace_text_atomically that a crash left in `folder`.

    Not this process's, and only when that pid is gone on this host or the file is old (a pid seen
    from another node means nothing here).
    """
    removed: list[str] = []
    if not isinstance(folder, Path):
        return removed  # an object store: replacing an object takes no temporary name
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


def sha256_of_file(path: Any, chunk: int = 8 << 20) -> str:
    """The sha256 of a local file or an object (anything with `open("rb")`)."""
    h = hashlib.sha256()
    with path.open("rb") if hasattr(path, "open") else open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def pid_exists(pid: int) -> bool:
    """Whether a process of this id runs on this host (one we may not signal counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
