"""The operations on a run folder whose meaning depends on where it lives (see storage/__init__.py)."""

from __future__ import annotations

from typing import Any, Protocol


class DurableStream(Protocol):
    """A file being written: bytes go in with `write`; after the `with` block, `size` and `sha256`."""

    size: int
    sha256: str

    def write(self, data: bytes | memoryview) -> int: ...


class Storage(Protocol):
    renames_atomically: bool

    def create(self, path: Any) -> Any:
        """A context manager yielding a DurableStream. On a clean exit the file is durable and whole;
        on an exception nothing is left at `path` (no torn file)."""
        ...

    def write(self, path: Any, data: bytes | memoryview) -> str:
        """Write `data` durably to `path`; return its sha256."""
        ...

    def replace_text(self, path: Any, text: str) -> None:
        """Readers see the old content or the new one, never a mix, even across a crash."""
        ...

    def append_line(self, path: Any, line: str) -> None:
        """Append `line` and a newline durably, on a line of its own even after a torn last line."""
        ...

    def sync_folder(self, path: Any) -> None:
        """Make the names of new entries in `path` survive a power loss."""
        ...

    def move_tree(self, source: Any, target: Any) -> None:
        """Move a folder and all it holds to `target` (on the same storage)."""
        ...

    def remove_tree(self, path: Any) -> None:
        """Remove a folder and all it holds; missing is fine."""
        ...
