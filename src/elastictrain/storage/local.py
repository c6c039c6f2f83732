"""A run folder on a local (POSIX) file system: fsync for durability, rename for atomicity."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from elastictrain.storage.durable import (
    HashingStream,
    create_durably,
    fsync_dir,
    replace_text_atomically,
    write_bytes_durably,
)


class LocalStorage:
    renames_atomically = True

    @contextlib.contextmanager
    def create(self, path: Path) -> Iterator[HashingStream]:
        with create_durably(path) as stream:
            yield stream

    def write(self, path: Path, data: bytes | memoryview) -> str:
        return write_bytes_durably(path, data)

    def replace_text(self, path: Path, text: str) -> None:
        replace_text_atomically(path, text)

    def append_line(self, path: Path, line: str) -> None:
        with open(path, "a+b") as f:
            created = f.seek(0, os.SEEK_END) == 0
            if f.tell() > 0:
                f.seek(-1, os.SEEK_END)
                # A crash mid-write leaves a line without its newline: end it so this record
                # stays readable on a line of its own.
                if f.read(1) != b"\n":
                    line = "\n" + line
            f.seek(0, os.SEEK_END)
            f.write((line + "\n").encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        if created:  # the new file's name must survive a power loss too
            fsync_dir(path.parent)

    def sync_folder(self, path: Path) -> None:
        fsync_dir(path)

    def move_tree(self, source: Path, target: Path) -> None:
        shutil.move(str(source), target)

    def remove_tree(self, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)


LOCAL = LocalStorage()
