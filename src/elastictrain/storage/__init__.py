"""Where a run folder lives: a local (POSIX) folder or an object store URL, behind one interface.

`as_path(location)` gives a `Path` for a local folder and an `ObjectPath` for `s3://...` (any
fsspec URL); `storage_of(path)` gives the operations whose meaning differs between the two:

| operation                | local folder                         | object store                     |
|--------------------------|--------------------------------------|----------------------------------|
| `create` / `write`       | write, fsync; a failed write unlinks | one upload, visible only whole   |
| `replace_text`           | write aside, fsync, rename           | one PUT (atomic by itself)       |
| `append_line`            | append, fsync                        | read, add, PUT                   |
| `sync_folder`            | fsync the folder                     | nothing to do                    |
| `remove_tree`            | rmtree                               | delete every object under it     |
| `renames_atomically`     | True: commit a folder by rename      | False: commit by writing last    |
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elastictrain.storage.interface import DurableStream, Storage
from elastictrain.storage.objects import ObjectPath, is_url, url_problems

AnyPath = Path | ObjectPath

__all__ = [
    "AnyPath",
    "DurableStream",
    "ObjectPath",
    "Storage",
    "as_path",
    "is_url",
    "storage_of",
    "url_problems",
]


def as_path(location: Any) -> AnyPath:
    """A local Path, or an ObjectPath for a URL; an ObjectPath or Path is returned as it is."""
    if isinstance(location, Path | ObjectPath):
        return location
    text = str(location)
    if text.startswith("file://"):
        return Path(text[len("file://") :])
    return ObjectPath(text) if is_url(text) else Path(text)


def storage_of(path: AnyPath) -> Storage:
    from elastictrain.storage.local import LOCAL
    from elastictrain.storage.object_storage import OBJECTS

    return OBJECTS if isinstance(path, ObjectPath) else LOCAL
