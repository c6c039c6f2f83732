"""In-memory snapshots of a rank's state: held on the worker, served to peers, read back resharded.

A snapshot is exactly what a rank file holds (`rank_snapshot.take_snapshot`: fragments of the fp32 weights and
of each elementwise optimizer state, tagged with global offsets, plus scalars), kept in host memory
instead of written. Fragments do not depend on the world size, so a new attempt at any size loads
its slices from them through `MemoryReader`, the in-memory twin of `FragmentReader`, with the same
`load_local_state`.

A worker keeps the last two complete snapshots of its own rank and the last two replicas it holds for
its buddy: a snapshot is added only once its copy is complete, so a copy in progress never replaces
the last complete one, and the one before stays for a peer whose newer copy never completed. The one
each addition pushes out is kept as a spare: the next copy (or replica) of the same attempt is written
into its buffer instead of a new one: what a worker holds stays these buffers whatever its malloc keeps
of freed memory, and no copy pays the page faults of a new buffer's first touch.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from elastictrain.checkpoint.tensor_slices import parse
from elastictrain.checkpoint.zero_state import (
    Fragment,
    FragmentReader,
    fragments_metadata,
    parse_fragments_metadata,
)
from elastictrain.core.snapshot_plan import KEEP, SnapshotKey


@dataclass
class Snapshot:
    key: SnapshotKey
    tensors: dict[str, torch.Tensor]  # "param::field" -> CPU fp32 fragment
    fragments: dict[str, Fragment]
    scalars: dict[str, Any]
    copy_s: float = 0.0
    raw: Any = None  # checkpoint/rank_snapshot.Snapshot the tensors view (own copies: a checkpoint writes it)
    flat: torch.Tensor | None = None  # a replica's one buffer, which its tensors view

    @property
    def buffer(self) -> torch.Tensor | None:
        """The one buffer the tensors view (None for a snapshot made by hand)."""
        return self.raw.buffer if self.raw is not None else self.flat

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def meta(self) -> dict[str, Any]:
        """What a reader needs before any tensor: the fragments, the saved keys and the scalars."""
        return {"fragments": dict(self.fragments), "keys": list(self.tensors), "scalars": self.scalars}

    def to_wire(self) -> dict[str, Any]:
        """For a replica sent to a buddy: the one buffer the tensors view, as a numpy array (it travels
        through Ray's object store without pickling), and where each tensor lies in it. One array, not one
        per tensor: Ray serializes many views of one buffer an order of magnitude slower than one array."""
        flat, layout = self._flat_layout()
        wire = {"key": self.key, "flat": flat.numpy(), "layout": layout}
        return {**wire, "fragments": self.fragments, "scalars": self.scalars}

    def _flat_layout(self) -> tuple[torch.Tensor, dict[str, tuple[int, int]]]:
        """The buffer every tensor views and each one's (offset, length) in it; a snapshot whose tensors
        are not views of one buffer (made by hand) is packed into a new one."""
        flat = self.raw.buffer if self.raw is not None else self.flat
        views = flat is not None and all(
            t.dim() == 1 and t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            for t in self.tensors.values()
        )
        if flat is not None and views and flat.storage_offset() == 0 and flat.is_contiguous():
            return flat, {k: (t.storage_offset(), t.numel()) for k, t in self.tensors.items()}
        parts = {k: t.reshape(-1).to(torch.float32) for k, t in self.tensors.items()}
        packed = torch.cat(list(parts.values())) if parts else torch.empty(0, dtype=torch.float32)
        layout, offset = {}, 0
        for k, part in parts.items():
            layout[k], offset = (offset, part.numel()), offset + part.numel()
        return packed, layout

    def to_frame(self) -> tuple[dict[str, Any], Any]:
        """For a replica sent over a socket (replica_link.py): a JSON-ready header and the one
        buffer every tensor views, as a numpy array."""
        flat, layout = self._flat_layout()
        header = {
            "key": [self.key.attempt, self.key.world_size, self.key.rank, self.key.step],
            "layout": layout,
            "fragments": fragments_metadata(self.fragments),
            "scalars": self.scalars,
        }
        return header, flat.numpy()

    @staticmethod
    def from_frame(header: dict[str, Any], data: Any) -> Snapshot:
        """A replica received over a socket; `data` (a float32 numpy array) is the buddy's to keep."""
        flat = torch.from_numpy(data)
        tensors = {k: flat.narrow(0, off, n) for k, (off, n) in header["layout"].items()}
        fragments = parse_fragments_metadata(header["fragments"])
        return Snapshot(SnapshotKey(*header["key"]), tensors, fragments, header["scalars"], flat=flat)

    @staticmethod
    def from_wire(wire: dict[str, Any], into: torch.Tensor | None = None) -> Snapshot:
        # Copied out of the (read-only, shared) object-store buffer, into `into` where it is given (a
        # spare of the right size): the replica is ours to keep.
        src = torch.from_numpy(wire["flat"])
        flat = into.copy_(src) if into is not None and into.numel() == src.numel() else src.clone()
        tensors = {k: flat.narrow(0, off, n) for k, (off, n) in wire["layout"].items()}
        return Snapshot(wire["key"], tensors, wire["fragments"], wire["scalars"], flat=flat)


@dataclass
class SnapshotStore:
    """A worker's complete snapshots: its own rank's and the replicas it holds for its buddy."""

    own: deque[Snapshot] = field(default_factory=lambda: deque(maxlen=KEEP))
    replicas: deque[Snapshot] = field(default_factory=lambda: deque(maxlen=KEEP))
    handed: list[Snapshot] = field(default_factory=list)  # from a peer replaced while it held them
    # The last snapshot pushed out of `own` and of `replicas`: no longer held, its buffer kept for reuse.
    spares: dict[bool, Snapshot] = field(default_factory=dict)  # own? -> snapshot
    filling: dict[bool, Snapshot] = field(default_factory=dict)  # spares being written into, until added
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add_own(self, snapshot: Snapshot) -> None:
        with self._lock:
            self._push(self.own, snapshot, own=True)
            # Handed-over snapshots serve the restart after the failure they were saved from, no later.
            self.handed = [s for s in self.handed if s.key.attempt >= snapshot.key.attempt]

    def add_replica(self, snapshot: Snapshot) -> None:
        with self._lock:
            self._push(self.replicas, snapshot, own=False)

    def _push(self, kept: deque[Snapshot], snapshot: Snapshot, *, own: bool) -> None:
        self.filling.pop(own, None)
        if len(kept) == kept.maxlen and kept[0].buffer is not None:
            self.spares[own] = kept[0]
        kept.append(snapshot)

    def take_spare(self, *, own: bool, attempt: int, numel: int | None = None) -> Snapshot | None:
        """The spare pushed out of `own` (or `replicas`) for a new copy of `numel` elements to be written
        into, or None. Only a spare of the same attempt: an earlier attempt's snapshots may be what a
        load of this one is reading (it planned from them before they were pushed out)."""
        with self._lock:
            spare = self.spares.get(own)
            if spare is None:
                return None
            del self.spares[own]  # reused, or (another attempt's or size) let go
            buffer = spare.buffer
            if spare.key.attempt != attempt or buffer is None or numel not in (None, buffer.numel()):
                return None
            self.filling[own] = spare
            return spare

    def add_handed(self, snapshot: Snapshot) -> None:
        with self._lock:
            self.handed.append(snapshot)

    def all(self) -> list[Snapshot]:
        with self._lock:
            return [*self.own, *self.replicas, *self.handed]

    def holdings(self) -> list[dict[str, Any]]:
        """Every snapshot held, as plain values for the controller (core.snapshot_plan.Held)."""
        with self._lock:
            kept = ((True, self.own), (False, self.replicas), (False, self.handed))
            return [{**vars(s.key), "own": own} for own, snaps in kept for s in snaps]

    def find(self, key: SnapshotKey) -> Snapshot | None:
        for s in self.all():
            if s.key == key:
                return s
        return None

    def get(self, key: SnapshotKey) -> Snapshot:
        found = self.find(key)
        if found is None:
            raise KeyError(
                f"no in-memory snapshot of rank {key.rank} at step {key.step} (attempt {key.attempt})"
            )
        return found

    def nbytes(self) -> int:
        """The bytes of every snapshot held and of the spare buffers kept for (or filled by) the next ones."""
        with self._lock:
            spares = sum(s.nbytes for s in [*self.spares.values(), *self.filling.values()])
        return sum(s.nbytes for s in self.all()) + spares


def keys_to_fetch(
    metas: dict[int, dict[str, Any]], wanted: Iterable[tuple[str, int, int]], full_fp32: bool
) -> dict[int, list[str]]:
    """Per old rank, the saved tensors that overlap the element ranges a new rank loads.

    `wanted`: (parameter, start, length) of every slice the new rank fills, each in every field;
    `full_fp32`: the layout also needs every parameter's whole fp32 weights (ZeRO-1/2 set each rank's
    low-precision copy of every parameter from them). Whole fragments move, never more. A parameter the
    old ranks held as tensor-parallel slices of another degree is read whole (joined, then cut): every
    fragment of it moves.
    """
    ranges: dict[str, list[tuple[int, int]]] = {}
    degrees: dict[str, int] = {}  # parameter -> the degree the new rank holds it at
    for name, start, length in wanted:
        ranges.setdefault(name, []).append((start, start + length))
        base, piece = parse(name)
        degrees[base] = piece.count if piece else 1
    out: dict[int, list[str]] = {}
    for rank, meta in metas.items():
        keys = []
        for key in meta["keys"]:
            name, _, fld = key.rpartition("::")
            frag = meta["fragments"].get(name)
            if frag is None:
                continue
            lo, hi = frag.start, frag.start + frag.length
            base, piece = parse(name)
            other_layout = base in degrees and (piece.count if piece else 1) != degrees[base]
            needed = other_layout or any(a < hi and lo < b for a, b in ranges.get(name, ()))
            if needed or (full_fp32 and fld == "fp32"):
                keys.append(key)
        if keys:
            out[rank] = keys
    return out


class _Tensors:
    """A dict of tensors seen as a safetensors handle: `get_slice(key)[lo:hi]`."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._tensors = tensors

    def get_slice(self, key: str) -> torch.Tensor:
        try:
            return self._tensors[key]
        except KeyError:
            raise KeyError(f"{key}: not fetched from the in-memory snapshot") from None


class MemoryReader(FragmentReader):
    """`FragmentReader` over in-memory snapshots: the fragments of every old rank, the fetched tensors.

    Only the index is built differently; reading, fields and whole parameters are FragmentReader's.
    """

    def __init__(self, metas: dict[int, dict[str, Any]], tensors: dict[int, dict[str, torch.Tensor]]) -> None:
        self._handles = []
        self._index = {}
        self._saved = {}
        self._fields = {}
        for rank, meta in sorted(metas.items()):
            handle = _Tensors(tensors.get(rank, {}))
            self._handles.append(handle)
            for key in meta["keys"]:
                name, _, fld = key.rpartition("::")
                fields = self._fields.setdefault(name, [])
                if fld not in fields:
                    fields.append(fld)
            for name, frag in meta["fragments"].items():
                self._index.setdefault(name, []).append((frag.start, frag.length, handle))
                self._saved[name] = Fragment(0, frag.numel, frag.numel, frag.shape)
        self._finish_index()
