"""A run folder on an object store: an object appears whole or not at all, and nothing renames.

An upload becomes visible only when it completes (a multipart upload is completed last; one killed
before leaves no object), so "durable and whole" needs no fsync; and a PUT replaces an object
atomically, so `latest` and run.json need no temporary name. What an object store lacks is a rename
of a folder: checkpoints are committed by writing their manifest after every rank's object
(checkpoint/store.py), and a reader trusts no checkpoint without its manifest.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from elastictrain.storage.durable import HashingStream, crash_point, phase_of
from elastictrain.storage.objects import ObjectPath


class ObjectStorage:
    renames_atomically = False

    @contextlib.contextmanager
    def create(self, path: ObjectPath) -> Iterator[HashingStream]:
        phase = phase_of(path)
        # autocommit off: the object appears only at commit(); discard() aborts the upload instead.
        f = path.fs.open(path.key, "wb", autocommit=False)
        stream = HashingStream(f, phase, sync=lambda: None)
        try:
            yield stream
            f.close()
            f.commit()
        except BaseException:
            with contextlib.suppress(Exception):
                f.discard()
            raise
        stream.finish()
        if phase is not None:
            crash_point(f"{phase}_written")

    def write(self, path: ObjectPath, data: bytes | memoryview) -> str:
        with self.create(path) as stream:
            stream.write(data)
        return stream.sha256

    def replace_text(self, path: ObjectPath, text: str) -> None:
        path.write_bytes(text.encode("utf-8"))  # one PUT: readers see the old object or the new

    def append_line(self, path: ObjectPath, line: str) -> None:
        # No append on object stores: read, add, write back (a run folder has one writer, its
        # driver). Fine for events.jsonl's few hundred lines; not for a high-rate log.
        try:
            old = path.read_bytes()
        except FileNotFoundError:
            old = b""
        if old and not old.endswith(b"\n"):
            old += b"\n"
        path.write_bytes(old + (line + "\n").encode("utf-8"))

    def sync_folder(self, path: ObjectPath) -> None:
        """Object names are durable once their upload completes."""

    def move_tree(self, source: ObjectPath, target: ObjectPath) -> None:
        # No rename: every object is copied, then deleted (not atomic; only `train --fresh` uses it).
        source.fs.mv(source.key, target.key, recursive=True)

    def remove_tree(self, path: ObjectPath) -> None:
        with contextlib.suppress(FileNotFoundError):
            path.fs.rm(path.key, recursive=True)


OBJECTS = ObjectStorage()
