"""The reference log-probabilities of a full fine-tune, kept in the run folder (RUN_DIR/reference/).

Computed once, before the first step, by the workers (worker/reference_share.py) in chunks of
CHUNK_ITEMS items whose bounds do not depend on the world size; the driver writes each chunk as it
completes (`part-START-STOP.npy`), so a pass cut short by a failure goes on from the chunks written.
Once every chunk is there they become one table, `logps.npy` ([items, 2] float32: each item's first
and second row), and `manifest.json` records its items, sha256 and digest of the data it covers: what
every attempt, resize and resume loads (and checks) instead of a second model.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from elastictrain.storage import AnyPath, storage_of

CHUNK_ITEMS = 1024
TABLE = "logps.npy"
MANIFEST = "manifest.json"


class ReferenceError(RuntimeError):
    """A reference table that is missing, torn or for other data; the message says what to do."""


@dataclass(frozen=True)
class ReferenceTable:
    folder: str
    items: int
    sha256: str


def chunks(items: int, size: int = CHUNK_ITEMS) -> list[tuple[int, int]]:
    """[start, stop) of every chunk of `items` items."""
    return [(a, min(a + size, items)) for a in range(0, items, size)]


def _part(folder: AnyPath, start: int, stop: int) -> AnyPath:
    return folder / f"part-{start:09d}-{stop:09d}.npy"


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def _load(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def done_chunks(folder: AnyPath, items: int, size: int = CHUNK_ITEMS) -> set[tuple[int, int]]:
    """The chunks of `items` already written (a part whose shape is wrong counts as not written)."""
    out = set()
    for start, stop in chunks(items, size):
        path = _part(folder, start, stop)
        if path.exists():
            try:
                if _load(path.read_bytes()).shape == (stop - start, 2):
                    out.add((start, stop))
            except (OSError, ValueError):
                pass  # torn by a crash on a filesystem without atomic writes: computed again
    return out


def write_chunk(folder: AnyPath, start: int, values: np.ndarray) -> None:
    stop = start + len(values)
    folder.mkdir(parents=True, exist_ok=True)
    storage_of(folder).write(_part(folder, start, stop), _npy(values.astype(np.float32)))


def read_manifest(folder: AnyPath) -> dict[str, Any] | None:
    path = folder / MANIFEST
    if not path.exists():
        return None
    return dict(json.loads(path.read_text()))


def finish(folder: AnyPath, items: int, data_digest: str, size: int = CHUNK_ITEMS) -> ReferenceTable:
    """Join the chunks into the table; the manifest is written last (the table counts once it is)."""
    parts = [_load(_part(folder, a, b).read_bytes()) for a, b in chunks(items, size)]
    table = np.concatenate(parts).astype(np.float32)
    if table.shape != (items, 2) or not np.isfinite(table).all():
        raise ReferenceError(
            f"reference log-probabilities in {folder}: expected {items} finite rows of 2, got shape "
            f"{table.shape}; remove {folder} to compute them again (the run must start from step 0)"
        )
    store = storage_of(folder)
    sha = store.write(folder / TABLE, _npy(table))
    manifest = {"items": items, "sha256": sha, "data_digest": data_digest, "chunk_items": size}
    store.replace_text(folder / MANIFEST, json.dumps(manifest, indent=1))
    for a, b in chunks(items, size):
        _part(folder, a, b).unlink(missing_ok=True)
    return ReferenceTable(str(folder), items, sha)


def complete(folder: AnyPath, items: int, data_digest: str) -> ReferenceTable | None:
    """The finished table for these data, None when none is finished; refuses one for other data."""
    manifest = read_manifest(folder)
    if manifest is None:
        return None
    if manifest.get("items") != items or manifest.get("data_digest") != data_digest:
        raise ReferenceError(
            f"{folder / MANIFEST}: reference log-probabilities of {manifest.get('items')} items of other "
            f"data (digest {manifest.get('data_digest')}), not of this run's {items} items "
            f"({data_digest}); the data changed since they were computed: train the changed data as a new "
            "run (--fresh), or restore the data they were computed from"
        )
    return ReferenceTable(str(folder), items, str(manifest["sha256"]))


def load_table(table: ReferenceTable) -> np.ndarray:
    """The [items, 2] table, its sha256 checked against the manifest's."""
    from elastictrain.storage import as_path

    data = (as_path(table.folder) / TABLE).read_bytes()
    got = hashlib.sha256(data).hexdigest()
    if got != table.sha256:
        raise ReferenceError(
            f"{table.folder}/{TABLE}: sha256 {got} differs from its manifest's {table.sha256}: the file "
            "was changed or torn; a run past step 0 cannot compute it again from the starting model"
        )
    values = _load(data)
    if values.shape != (table.items, 2):
        raise ReferenceError(f"{table.folder}/{TABLE}: shape {values.shape}; expected ({table.items}, 2)")
    return values
