"""The commit protocol of checkpoints in RUN_DIR/checkpoints.

Ranks write their files into a hidden staging folder. Only when every rank has reported its files
(durably written, with sizes and sha256) does the controller write `manifest.json` (fsynced), rename the
staging folder to `step-NNNNNN` (a rename is atomic), fsync the parent, and then replace `latest`.
A crash at any moment leaves either no new folder, a hidden partial one (cleaned up later), or a
committed one: the previous committed checkpoint stays loadable throughout. Folders are deleted by
first renaming them to a hidden `.trash-` name, so a crash mid-delete never leaves a half-deleted
folder that still holds its manifest. Every file's sha256 is checked again before a checkpoint is
loaded (`verify_checkpoint`); one that fails is rejected and the previous one is used.

On an object store (`run.dir: s3://...`) there is no rename: ranks write their objects straight
into `step-NNNNNN/`, and writing `manifest.json` after all of them is the commit (an upload appears
whole or not at all); `latest` is replaced last, by one PUT. A `step-NNNNNN/` without its manifest is
an unfinished save, never loaded, removed at the next start; deleting a checkpoint deletes its
manifest first, so a crash mid-delete leaves an uncommitted folder, not a damaged checkpoint.

Crash points (see durable.crash_point), in the order a save passes them: shard_partial,
shard_written, manifest_partial, manifest_written, renamed, latest_tmp_written, committed (on an
object store: shard_partial, shard_written, manifest_partial, manifest_written, committed).
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from elastictrain.core.checkpoints import (
    CheckpointListing,
    choose_resume_tag,
    step_of_tag,
    tag_for_step,
    tags_to_delete,
)
from elastictrain.storage import AnyPath, as_path, storage_of
from elastictrain.storage.durable import crash_point, sha256_of_file

MANIFEST = "manifest.json"
FORMAT = "elastictrain.zero3-fragments/1"
STAGING_PREFIX = ".staging-"
TRASH_PREFIX = ".trash-"


class CheckpointError(RuntimeError):
    pass


@dataclass(frozen=True)
class Committed:
    tag: str
    path: AnyPath
    manifest: dict[str, Any]


class CheckpointStore:
    def __init__(self, root: str | AnyPath) -> None:
        self.root = as_path(root)
        self._io = storage_of(self.root)

    def begin(self, step: int) -> AnyPath:
        """A fresh, empty folder for the ranks' files of the checkpoint after `step` optimizer steps:
        a hidden staging folder on a local disk, the checkpoint's own (uncommitted) folder on an
        object store."""
        tag = tag_for_step(step)
        if not self._io.renames_atomically:
            folder = self.root / tag
            if folder.exists():  # an earlier save of this step (e.g. one rejected on load): out first
                self._discard(folder)
            return folder
        if not self.root.is_dir():
            self.root.mkdir(parents=True, exist_ok=True)
            self._io.sync_folder(self.root.parent)  # the new checkpoints/ folder survives a power loss
        staging = self.root / f"{STAGING_PREFIX}{tag}"
        if staging.exists():
            self._io.remove_tree(staging)
        staging.mkdir()
        return staging

    def commit(
        self, step: int, staging: AnyPath, files: list[dict[str, Any]], fields: dict[str, Any]
    ) -> Committed:
        """Make a staged checkpoint count: manifest, rename (local disks), then `latest`.
        Files must all be present."""
        tag = tag_for_step(step)
        staging = as_path(staging)
        for f in files:
            path = staging / f["name"]
            if not path.is_file() or path.stat().st_size != f["bytes"]:
                raise CheckpointError(
                    f"checkpoint {tag}: {f['name']} is missing or has the wrong size; not committed"
                )
        manifest = {
            "format": FORMAT,
            "tag": tag,
            "step": step,
            "created_at": datetime.now(timezone.utc).isoformat(),
            **fields,
            "files": sorted(files, key=lambda f: f["name"]),
        }
        self._io.write(staging / MANIFEST, json.dumps(manifest, indent=1).encode())
        final = self.root / tag
        if self._io.renames_atomically:
            self._io.sync_folder(staging)
            if final.exists():  # an older commit of the same step (e.g. re-run after a crash): replace it
                self._discard(final)
            os.rename(staging, final)
            self._io.sync_folder(self.root)
            crash_point("renamed")
        # On an object store the manifest's upload was the commit; `latest` follows.
        self._io.replace_text(self.root / "latest", tag + "\n")
        crash_point("committed")
        return Committed(tag, final, manifest)

    def abandon(self, staging: AnyPath) -> None:
        """Drop a save that cannot complete (e.g. the disk is full); committed checkpoints stay."""
        self._io.remove_tree(as_path(staging))

    def _discard(self, folder: AnyPath) -> None:
        # A crash mid-delete must not leave a half-deleted checkpoint that still looks committed.
        if not self._io.renames_atomically:
            (folder / MANIFEST).unlink(missing_ok=True)  # uncommitted first
            self._io.remove_tree(folder)
            return
        trash = self.root / f"{TRASH_PREFIX}{folder.name}-{os.getpid()}-{time.monotonic_ns()}"
        os.rename(folder, trash)  # atomically out of sight first
        self._io.sync_folder(self.root)
        self._io.remove_tree(trash)

    def listing(self) -> CheckpointListing:
        if not self.root.is_dir():
            return CheckpointListing((), None)
        committed = tuple(
            sorted(
                (
                    p.name
                    for p in self.root.iterdir()
                    if step_of_tag(p.name) is not None and (p / MANIFEST).is_file()
                ),
                key=lambda t: step_of_tag(t) or 0,
            )
        )
        latest_file = self.root / "latest"
        latest = latest_file.read_text().strip() if latest_file.is_file() else None
        return CheckpointListing(committed, latest or None)

    def manifest(self, tag: str) -> dict[str, Any]:
        path = self.root / tag / MANIFEST
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"checkpoint {tag}: cannot read {path}: {e}") from e

    def latest_committed(self, rejected: tuple[str, ...] = ()) -> Committed | None:
        tag = choose_resume_tag(self.listing(), rejected)
        return None if tag is None else Committed(tag, self.root / tag, self.manifest(tag))

    def prune(self, keep_last: int, protect: tuple[str, ...] = ()) -> list[str]:
        doomed = tags_to_delete(self.listing().committed, keep_last, protect)
        for tag in doomed:
            self._discard(self.root / tag)
        return doomed

    def clean_partials(self) -> list[str]:
        """Remove what a crash mid-save or mid-delete left (staging, trash, temporary `latest`; on an
        object store, step folders without a manifest)."""
        if not self.root.is_dir():
            return []
        prefixes = (STAGING_PREFIX, TRASH_PREFIX, ".latest.tmp-")
        removed = []
        for path in sorted(self.root.iterdir(), key=lambda p: p.name):
            unfinished = (
                not self._io.renames_atomically
                and step_of_tag(path.name) is not None
                and not (path / MANIFEST).is_file()
            )
            if not (path.name.startswith(prefixes) or unfinished):
                continue
            removed.append(path.name)
            if path.is_dir():
                self._io.remove_tree(path)
            else:
                path.unlink(missing_ok=True)
        return removed


@dataclass(frozen=True)
class Verification:
    path: AnyPath
    problems: list[str]
    files: int
    bytes: int
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.problems


def _check_file(path: AnyPath, entry: Any) -> str | None:
    if not isinstance(entry, dict) or not {"name", "bytes", "sha256"} <= set(entry):
        return f"{path / MANIFEST}: a file entry lacks name, bytes or sha256 ({entry!r})"
    name = str(entry["name"])
    file = path / name
    # A manifest names files inside its own folder only: no absolute paths, no '..'.
    if Path(name).is_absolute() or ".." in Path(name).parts:
        return f"{path / MANIFEST}: file name {name!r} points outside the checkpoint folder"
    if not file.is_file():
        return f"{file}: missing"
    try:
        size = file.stat().st_size
        if size != entry["bytes"]:
            return f"{file}: {size} bytes, manifest says {entry['bytes']} (truncated or altered)"
        if sha256_of_file(file) != entry["sha256"]:
            return f"{file}: sha256 differs from the manifest (corrupted)"
    except OSError as e:  # EACCES, EIO: a file that cannot be read cannot be loaded either
        return f"{file}: unreadable ({e.strerror or e})"
    return None


def verify(path: AnyPath, threads: int = 8) -> Verification:
    """Check every file of a checkpoint folder against its manifest's sizes and sha256.

    Files are hashed in parallel threads (hashlib releases the GIL), so this costs about one read of
    the checkpoint at disk speed.
    """
    t0 = time.perf_counter()
    path = as_path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        entries = manifest["files"]
        if not isinstance(entries, list) or not entries:
            raise ValueError("no 'files' list")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return Verification(path, [f"{path / MANIFEST}: unreadable or not a manifest ({e})"], 0, 0, 0.0)
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(entries)))) as pool:
        results = list(pool.map(lambda entry: _check_file(path, entry), entries))
    total = sum(int(e.get("bytes", 0)) for e in entries if isinstance(e, dict))
    problems = [r for r in results if r]
    return Verification(path, problems, len(entries), total, time.perf_counter() - t0)


def verify_checkpoint(path: AnyPath) -> list[str]:
    """Problems found in a committed checkpoint folder: missing, truncated or altered files."""
    return verify(path).problems
