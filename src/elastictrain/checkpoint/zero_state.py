"""Read and write a DeepSpeed engine's state as world-size-independent fragments, for any ZeRO stage.

Each rank saves, for every parameter, the slices of its flattened fp32 master weights and of each
elementwise optimizer state that it owns (checkpoint/zero_layouts.py says where they live in stage 0,
1, 2 and 3), tagged with the slices' global offsets. Loading at any world size M, under any stage,
then means: each new rank asks for its own slices and reads exactly those bytes from whichever old
files hold them. There is no conversion step (unlike `ds_to_universal`), the fragments do not depend
on the stage that wrote them (a ZeRO-2 checkpoint loads under ZeRO-3 and the reverse), and it works
when the ZeRO-3 optimizer state is swapped to NVMe, because we go through its own swap-in / swap-out.

This touches DeepSpeed internals (ZeRO-3's fp16_groups, grad_position, fp32_partitioned_groups_flat
and swap helpers; ZeRO-1/2's `_hp_mapping` tensor fragments); they are the ones its universal
checkpoint uses. Tested against the installed version by the reshard tests.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from typing import Any

import torch

from elastictrain.checkpoint.tensor_slices import TensorSlice, join, parse
from elastictrain.checkpoint.zero_layouts import (
    FP32,
    LocalSlice,
    layout_for,
    rebuild_scalar,
    scalar_device,
)

FRAGMENTS_KEY = "elastictrain.fragments"


@dataclass(frozen=True)
class Fragment:
    """Elements [start, start+length) of a flattened parameter of `numel` elements and `shape`."""

    start: int
    length: int
    numel: int
    shape: tuple[int, ...]


def _optimizer_name(engine: Any) -> str:
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    return type(inner).__name__


def fragments_of(pieces: list[LocalSlice]) -> dict[str, Fragment]:
    return {p.name: Fragment(p.start, p.length, p.numel, p.shape) for p in pieces}


def rank_file(rank: int, world_size: int, fragments: dict[str, Fragment]) -> tuple[str, dict[str, str]]:
    """A rank's fragment file: its name and the safetensors metadata that makes it one of ours."""
    name = f"rank-{rank:05d}-of-{world_size:05d}.safetensors"
    metadata = {
        FRAGMENTS_KEY: fragments_metadata(fragments),
        "rank": str(rank),
        "world_size": str(world_size),
    }
    return name, metadata


def fragments_metadata(fragments: dict[str, Fragment]) -> str:
    return json.dumps({n: [f.start, f.length, f.numel, list(f.shape)] for n, f in sorted(fragments.items())})


def parse_fragments_metadata(text: str) -> dict[str, Fragment]:
    return {n: Fragment(s, ln, nm, tuple(sh)) for n, (s, ln, nm, sh) in json.loads(text).items()}


class FragmentReader:
    """Reads any element range of any saved parameter from the fragment files of one checkpoint.

    A parameter saved as tensor-parallel slices (checkpoint/tensor_slices.py) reads as a whole under its
    own name (`params`, `full`) and as any slice of any tensor-parallel size under a slice's name."""

    def __init__(self, files: list[Any]) -> None:
        from elastictrain.storage.ranges import open_safetensors

        # Local files or objects (run.dir on an object store): either way only the bytes read are fetched.
        self._handles = [open_safetensors(f) for f in files]
        # saved name -> sorted starts, and the (start, length, handle) behind each
        self._index: dict[str, list[tuple[int, int, Any]]] = {}
        self._saved: dict[str, Fragment] = {}  # saved name -> the whole of what was saved under it
        self._fields: dict[str, list[str]] = {}  # name -> saved fields: "fp32" and the optimizer's states
        for path, handle in zip(files, self._handles, strict=True):
            for key in handle.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                name, _, field = key.rpartition("::")
                fields = self._fields.setdefault(name, [])
                if field not in fields:
                    fields.append(field)
            meta = handle.metadata() or {}
            if FRAGMENTS_KEY not in meta:
                raise ValueError(f"{path}: not an elastictrain fragment file (no {FRAGMENTS_KEY} metadata)")
            for name, frag in parse_fragments_metadata(meta[FRAGMENTS_KEY]).items():
                self._index.setdefault(name, []).append((frag.start, frag.length, handle))
                self._saved[name] = Fragment(0, frag.numel, frag.numel, frag.shape)
        self._finish_index()

    def _finish_index(self) -> None:
        """Sort each saved name's fragments and see the parameters saved as tensor-parallel slices."""
        for parts in self._index.values():
            parts.sort(key=lambda p: p[0])
        self._sliced: dict[str, dict[int, str]] = {}  # parameter -> slice index -> saved name
        self._slicing: dict[str, TensorSlice] = {}  # parameter -> how it was sliced (index 0's)
        for saved in self._saved:
            base, piece = parse(saved)
            if piece is not None:
                self._sliced.setdefault(base, {})[piece.index] = saved
                self._slicing.setdefault(base, TensorSlice(piece.dim, 0, piece.count))
        self.params: dict[str, Fragment] = {n: f for n, f in self._saved.items() if parse(n)[1] is None}
        for base, by_index in self._sliced.items():
            self.params[base] = self._joined(base, by_index)
        self._cached: tuple[tuple[str, str], torch.Tensor] | None = None

    def _joined(self, base: str, by_index: dict[int, str]) -> Fragment:
        slicing = self._slicing[base]
        if sorted(by_index) != list(range(slicing.count)):
            raise ValueError(
                f"checkpoint holds slices {sorted(by_index)} of {slicing.count} of {base}: "
                "a rank's file is missing"
            )
        shapes = [self._saved[by_index[i]].shape for i in range(slicing.count)]
        shape = list(shapes[0])
        shape[slicing.dim] = sum(s[slicing.dim] for s in shapes)
        numel = math.prod(shape)
        return Fragment(0, numel, numel, tuple(shape))

    def has(self, name: str) -> bool:
        """Whether `name` (a parameter, or a slice of one at any tensor-parallel size) can be read."""
        return name in self._saved or parse(name)[0] in self.params

    def numel(self, name: str) -> int:
        """The elements of `name` as this checkpoint would give them (a slice: its share of the whole)."""
        if name in self._saved:
            return self._saved[name].numel
        base, piece = parse(name)
        whole = self.params[base].numel
        return whole // piece.count if piece is not None else whole

    def read(self, name: str, field: str, start: int, length: int) -> torch.Tensor:
        if name in self._index:
            return self._read_saved(name, field, start, length)
        base, piece = parse(name)
        if base not in self.params:
            raise KeyError(f"parameter {name!r} is not in this checkpoint")
        whole = self._whole(base, field)
        if piece is not None:
            whole = piece.cut(whole, base).contiguous()
        return whole.reshape(-1).narrow(0, start, length).clone()

    def _whole(self, base: str, field: str) -> torch.Tensor:
        """A parameter whole, joined from its slices (the last one kept: a rank reads it field by field)."""
        if self._cached is not None and self._cached[0] == (base, field):
            return self._cached[1]
        if base in self._index:
            whole = self.full(base, field)
        else:
            by_index, dim = self._sliced[base], self._slicing[base].dim
            parts = [self.full(by_index[i], field) for i in range(len(by_index))]
            whole = join(parts, dim)
        self._cached = ((base, field), whole)
        return whole

    def _read_saved(self, name: str, field: str, start: int, length: int) -> torch.Tensor:
        parts = self._index[name]
        out = torch.empty(length, dtype=torch.float32)
        pos = start
        i = max(0, bisect.bisect_right([p[0] for p in parts], start) - 1)
        while pos < start + length:
            if i >= len(parts) or parts[i][0] > pos:
                raise ValueError(
                    f"checkpoint has no data for {name}[{pos}] ({field}): a rank's file is missing"
                )
            frag_start, frag_len, handle = parts[i]
            lo, hi = pos - frag_start, min(frag_start + frag_len, start + length) - frag_start
            if lo < hi:
                out[pos - start : pos - start + hi - lo] = handle.get_slice(f"{name}::{field}")[lo:hi]
                pos += hi - lo
            i += 1
        return out

    def fields(self, name: str) -> list[str]:
        """What was saved for parameter `name`: "fp32" first, then its optimizer state's fields."""
        found = self._fields.get(name)
        if found is None:
            base = parse(name)[0]
            found = self._fields.get(base) or self._fields.get(
                next(iter(self._sliced.get(base, {}).values()), ""), []
            )
        return sorted(found, key=lambda f: (f != FP32, f))

    def full(self, name: str, field: str = FP32) -> torch.Tensor:
        if name in self._saved:
            frag = self._saved[name]
            return self._read_saved(name, field, 0, frag.numel).view(frag.shape)
        base, piece = parse(name)
        whole = self._whole(base, field) if base in self.params else None
        if whole is None:
            raise KeyError(f"parameter {name!r} is not in this checkpoint")
        return piece.cut(whole, base).contiguous() if piece is not None else whole


def _saved_scalars(scalars: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The optimizer's scalar state as saved; checkpoints before it was recorded kept only Adam's step."""
    saved = scalars.get("optimizer_state")
    if saved:
        return dict(saved)
    step = scalars.get("optimizer_step")
    if step is None:
        return {}
    return {"step": {"value": float(step), "kind": "tensor", "dtype": "torch.float32"}}


@torch.no_grad()
def load_local_state(engine: Any, reader: FragmentReader, scalars: dict[str, Any]) -> None:
    """Fill this rank's weights, optimizer state and step from a checkpoint of any world size or stage."""
    layout = layout_for(engine)
    saved_scalars = _saved_scalars(scalars)
    # Checked from the layout alone: opening a group would swap its NVMe-offloaded state in for nothing.
    names: set[str] = set()
    for piece in layout.load_slices():
        names.add(piece.name)
        if reader.has(piece.name) and reader.numel(piece.name) != piece.numel:
            saved = reader.numel(piece.name)
            raise ValueError(
                f"checkpoint does not match the model: {piece.name} has {saved} elements "
                f"in the checkpoint and {piece.numel} in the model"
            )
    missing = sorted(n for n in names if not reader.has(n))
    if missing:
        raise ValueError(f"checkpoint does not match the model: missing parameters {missing[:5]}")
    layout.before_load()
    for group in range(layout.num_groups()):
        # Every slice of every field is filled below: nothing needs reading in first.
        with layout.open(group, write_back=True, overwrite=True) as opened:
            pieces = opened.to_load()
            saved_fields = reader.fields(pieces[0].name) if pieces else []
            for field in saved_fields:
                if field != FP32 and field not in opened.fields():
                    # Optimizers create their state at their first step; a fresh engine has none yet.
                    opened.state[field] = torch.zeros_like(opened.fp32)
            targets = opened.fields()
            unknown = sorted(set(targets) - set(saved_fields)) if pieces else []
            if unknown:
                raise ValueError(
                    f"checkpoint has no {unknown} for {pieces[0].name}: it was saved with another "
                    f"optimizer than {_optimizer_name(engine)} (saved: {saved_fields})"
                )
            for key, spec in saved_scalars.items():
                device = scalar_device(engine.optimizer, opened.state.get(key), opened.fp32.device)
                opened.state[key] = rebuild_scalar(spec, device)
            for piece in pieces:
                for field, target in targets.items():
                    part = target.narrow(0, piece.offset, piece.length)
                    part.copy_(reader.read(piece.name, field, piece.start, piece.length).to(part.dtype))
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    for key, value in (scalars.get("loss_scaler") or {}).items():
        if scaler is not None and hasattr(scaler, key):
            setattr(scaler, key, type(getattr(scaler, key))(value))
    layout.after_load(reader)


def load_committed(engine: Any, checkpoint_dir: Any) -> None:
    """Load this rank's slices from a committed checkpoint folder (a local or object-store path)."""
    manifest = json.loads((checkpoint_dir / "manifest.json").read_text())
    entries = [f for f in manifest["files"] if f["name"].endswith(".safetensors")]
    files = [checkpoint_dir / f["name"] for f in entries]
    # The controller checked every sha256 before this attempt; a file truncated or removed since is
    # named here, before safetensors reads it.
    for f, path in zip(entries, files, strict=True):
        size = path.stat().st_size if path.is_file() else None
        if size != f["bytes"]:
            found = "missing" if size is None else f"{size} bytes"
            raise ValueError(f"checkpoint file {path}: {found}, manifest says {f['bytes']} bytes")
    load_local_state(engine, FragmentReader(files), manifest.get("engine_state", {}))
