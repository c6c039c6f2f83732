"""A location on an object store (`s3://bucket/key`, `gs://...`, any fsspec URL) that reads like a Path.

Only what run folders and checkpoints use of pathlib: joining, names, parents, listing, reading,
sizes. Listings always go to the store (no cached directory listing), because another process (a
rank, an earlier driver) may have written since. Credentials and endpoints come from the store's
usual environment (for S3: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, ...).
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

_URL = re.compile(r"([a-z][a-z0-9+.-]*)://(.+)")


def is_url(location: object) -> bool:
    """True for `scheme://...` other than file://: a location on an object store."""
    m = _URL.fullmatch(str(location))
    return m is not None and m.group(1) != "file"


@functools.cache
def filesystem(protocol: str) -> Any:
    import fsspec

    try:
        # No listings cache: ranks and other drivers write behind this process's back.
        return fsspec.filesystem(protocol, use_listings_cache=False, skip_instance_cache=True)
    except (ImportError, ValueError) as e:
        raise ValueError(
            f"{protocol}:// storage needs its fsspec package ({e}); for s3:// install s3fs "
            "(pip install s3fs), for gs:// gcsfs"
        ) from e


def url_problems(field: str, location: str) -> list[str]:
    """A URL whose store this process cannot reach for lack of its fsspec package (empty: fine)."""
    if not is_url(location):
        return []
    try:
        filesystem(ObjectPath(location).protocol)
    except ValueError as e:
        return [f"{field}: got {location!r}; {e}"]
    return []


@dataclass(frozen=True)
class Stat:
    st_size: int
    st_mtime: float


class ObjectPath:
    def __init__(self, url: str) -> None:
        m = _URL.fullmatch(str(url))
        if m is None:
            raise ValueError(f"{url!r} is not a URL (scheme://bucket/key)")
        self.protocol = m.group(1)
        self.key = m.group(2).rstrip("/")

    # ------------------------------------------------------------------ names
    def __str__(self) -> str:
        return f"{self.protocol}://{self.key}"

    def __repr__(self) -> str:
        return f"ObjectPath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectPath) and str(other) == str(self)

    def __hash__(self) -> int:
        return hash(str(self))

    def __truediv__(self, part: str) -> ObjectPath:
        return ObjectPath(f"{self}/{str(part).strip('/')}")

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def suffix(self) -> str:
        name = self.name
        return name[name.rfind(".") :] if "." in name.lstrip(".") else ""

    @property
    def parent(self) -> ObjectPath:
        head = self.key.rsplit("/", 1)[0] if "/" in self.key else self.key
        return ObjectPath(f"{self.protocol}://{head}")

    def with_name(self, name: str) -> ObjectPath:
        return self.parent / name

    def absolute(self) -> ObjectPath:
        return self

    def resolve(self) -> ObjectPath:
        return self

    @property
    def fs(self) -> Any:
        return filesystem(self.protocol)

    # ------------------------------------------------------------------ queries
    def is_file(self) -> bool:
        try:
            return bool(self.fs.isfile(self.key))
        except OSError:
            return False

    def is_dir(self) -> bool:
        # A "folder" is a prefix with at least one object under it.
        try:
            return bool(self.fs.ls(self.key, detail=False)) and not self.is_file()
        except (FileNotFoundError, OSError):
            return False

    def exists(self) -> bool:
        return self.is_file() or self.is_dir()

    def iterdir(self) -> Iterator[ObjectPath]:
        try:
            entries = self.fs.ls(self.key, detail=False)
        except FileNotFoundError:
            return iter(())
        return iter(
            ObjectPath(f"{self.protocol}://{e.rstrip('/')}") for e in entries if e.rstrip("/") != self.key
        )

    def glob(self, pattern: str) -> Iterator[ObjectPath]:
        found = self.fs.glob(f"{self.key}/{pattern}")
        return iter(ObjectPath(f"{self.protocol}://{k}") for k in sorted(found))

    def match(self, pattern: str) -> bool:
        return fnmatch.fnmatch(self.name, pattern)

    def stat(self) -> Stat:
        info = self.fs.info(self.key)
        modified = info.get("LastModified") or info.get("mtime") or info.get("updated")
        mtime = modified.timestamp() if hasattr(modified, "timestamp") else float(modified or 0.0)
        return Stat(int(info.get("size") or 0), mtime)

    # ------------------------------------------------------------------ data
    def open(self, mode: str = "rb") -> IO[Any]:
        return self.fs.open(self.key, mode)

    def read_bytes(self) -> bytes:
        return bytes(self.fs.cat_file(self.key))

    def read_range(self, start: int, end: int) -> bytes:
        return bytes(self.fs.cat_file(self.key, start=start, end=end))

    def read_text(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return self.read_bytes().decode(encoding, errors)

    def write_bytes(self, data: bytes) -> None:
        self.fs.pipe_file(self.key, bytes(data))

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Object stores have no folders: a prefix exists once an object is under it."""

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self.fs.rm_file(self.key)
        except FileNotFoundError:
            if not missing_ok:
                raise
