"""One rank's checkpoint file, planned once and filled group by group: from a host copy or streamed live.

The file is a safetensors file whose layout we plan ourselves: a header naming every fragment
("param::field", flat fp32) and its byte range, then the data group by group and, inside a group,
field by field, so that each (group, field) is one contiguous run on both sides in the common case:
one large copy and one large write instead of one per parameter.

Two ways to fill it:
- `take_snapshot`: copy the rank's state into one preallocated host buffer laid out exactly as the
  file's data (training may go on while a thread writes it; no serialization copy).
- `stream_chunks`: no copy at all: each group is opened (swapped in from NVMe where offloaded), its
  bytes handed to the writer straight from the live tensors, and closed before the next one, so
  the host memory used is one group's, whatever the model's size. Training waits for the write.

The actor picks one per save from the size and `checkpoint.max_host_memory_mb`.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from elastictrain.checkpoint.zero_layouts import (
    LocalSlice,
    OpenGroup,
    layout_for,
    scalar_state,
    unreshardable_state,
)

F32 = 4  # bytes per element: every fragment is saved as fp32
STAGE_ELEMENTS = 16 << 20  # 64 MiB of fp32: the bounce buffer for state that is not host fp32


@dataclass(frozen=True)
class Run:
    """Pieces of one (group, field) that are contiguous in the source: one copy, one write."""

    field: str
    source_offset: int  # elements, in the group's flat tensors
    file_offset: int  # elements, in the file's data section
    length: int


@dataclass
class RankFilePlan:
    """Where every fragment of this rank goes in its file; known once the first group is open."""

    fields: list[str]
    keys: dict[str, tuple[int, int]] = field(default_factory=dict)  # "param::field" -> (offset, length)
    runs: list[list[Run]] = field(default_factory=list)  # per group
    pieces: list[LocalSlice] = field(default_factory=list)
    numel: int = 0

    @property
    def data_bytes(self) -> int:
        return self.numel * F32

    def header(self, metadata: dict[str, str]) -> bytes:
        entries: dict[str, Any] = {"__metadata__": metadata}
        for key, (offset, length) in self.keys.items():
            entries[key] = {
                "dtype": "F32",
                "shape": [length],
                "data_offsets": [offset * F32, (offset + length) * F32],
            }
        text = json.dumps(entries, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # safetensors pads its header with spaces to 8 bytes
        return struct.pack("<Q", len(text)) + text


def plan_rank_file(group_slices: list[list[LocalSlice]], fields: list[str]) -> RankFilePlan:
    """Lay the data out group by group, field by field, piece by piece; merge source-contiguous pieces."""
    plan = RankFilePlan(fields=fields)
    pos = 0
    for pieces in group_slices:
        runs: list[Run] = []
        for name in fields:
            for piece in pieces:
                plan.keys[f"{piece.name}::{name}"] = (pos, piece.length)
                last = runs[-1] if runs else None
                if (
                    last is not None
                    and last.field == name
                    and last.source_offset + last.length == piece.offset
                    and last.file_offset + last.length == pos
                ):
                    runs[-1] = Run(name, last.source_offset, last.file_offset, last.length + piece.length)
                else:
                    runs.append(Run(name, piece.offset, pos, piece.length))
                pos += piece.length
        plan.runs.append(runs)
        plan.pieces.extend(pieces)
    plan.numel = pos
    return plan


@dataclass
class Walked:
    """What walking the groups found besides the bytes: the plan and the scalar state."""

    plan: RankFilePlan | None = None
    scalars: dict[str, Any] = field(default_factory=dict)


def _walk(engine: Any, found: Walked) -> Iterator[tuple[int, OpenGroup]]:
    """Open every group once, in order (read only); the plan is made when the first one is open."""
    layout = layout_for(engine)
    slices = [layout.save_slices(g) for g in range(layout.num_groups())]
    for group in range(layout.num_groups()):
        with layout.open(group, write_back=False) as opened:
            bad = unreshardable_state(opened)
            if bad:
                inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
                raise RuntimeError(
                    f"optimizer {type(inner).__name__}: state {bad} is neither elementwise nor a scalar, "
                    "so it cannot be resharded; use a fixed world size (min_workers == max_workers)"
                )
            if not found.scalars.get("optimizer_state"):
                found.scalars["optimizer_state"] = scalar_state(opened)
            fields = list(opened.fields())
            if found.plan is None:
                found.plan = plan_rank_file(slices, fields)
            elif fields != found.plan.fields and opened.slices:
                raise RuntimeError(f"group {group} holds state {fields}, group 0 {found.plan.fields}")
            yield group, opened
    if found.plan is None:  # an engine with no groups: an empty file
        found.plan = plan_rank_file([], ["fp32"])
    finish_scalars(engine, found.scalars)


def finish_scalars(engine: Any, scalars: dict[str, Any]) -> None:
    step = (scalars.get("optimizer_state") or {}).get("step")
    scalars["optimizer_step"] = step["value"] if step else None  # kept for checkpoints' readers
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is not None:
        scalars["loss_scaler"] = {
            k: float(v)
            for k, v in vars(scaler).items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }


@dataclass
class Snapshot:
    """A rank's state copied to host memory, laid out as its file's data section."""

    plan: RankFilePlan
    buffer: torch.Tensor
    scalars: dict[str, Any]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {key: self.buffer.narrow(0, off, n) for key, (off, n) in self.plan.keys.items()}

    def chunks(self, metadata: dict[str, str]) -> Iterator[Any]:
        yield self.plan.header(metadata)
        if self.plan.numel:
            yield self.buffer.numpy()


def snapshot_bytes(engine: Any) -> int:
    """The bytes a snapshot of the rank's state takes, from its plan (made on opening the first group;
    nothing is copied). Opening a group of state on NVMe swaps it in: for state in memory."""
    found = Walked()
    walker = _walk(engine, found)
    try:
        next(walker, None)
    finally:
        walker.close()
    assert found.plan is not None
    return found.plan.data_bytes


@torch.no_grad()
def take_snapshot(
    engine: Any,
    max_bytes: float = float("inf"),
    found: Walked | None = None,
    into: torch.Tensor | None = None,
) -> Snapshot | None:
    """Copy the rank's state into one host buffer (`into` where it has the plan's size, else a new one);
    None when it would exceed `max_bytes`, decided from the plan before anything is allocated
    (`found.plan` then says how large it would have been)."""
    found = found if found is not None else Walked()
    buffer: torch.Tensor | None = None
    for group, opened in _walk(engine, found):
        plan = found.plan
        assert plan is not None
        if buffer is None:
            if plan.data_bytes > max_bytes:
                return None
            if into is not None and into.numel() == plan.numel:
                buffer = into
            else:
                pin = opened.fp32.is_cuda  # pinned host memory lets a GPU copy run at full speed
                buffer = torch.empty(plan.numel, dtype=torch.float32, pin_memory=pin)
        sources = opened.fields()
        for run in plan.runs[group]:
            src = sources[run.field].narrow(0, run.source_offset, run.length)
            buffer.narrow(0, run.file_offset, run.length).copy_(src)
    assert found.plan is not None
    if buffer is None:
        buffer = torch.empty(found.plan.numel, dtype=torch.float32)
    return Snapshot(found.plan, buffer, found.scalars)


def stream_chunks(engine: Any, metadata_for: Any, walked: Walked) -> Iterator[Any]:
    """The rank's file as chunks read from the live state, one group open at a time (nothing copied
    for host fp32 state; a bounded bounce buffer otherwise). `metadata_for(plan)` gives the header's
    metadata; `walked` receives the plan and scalars."""
    stage: torch.Tensor | None = None
    with torch.no_grad():
        for group, opened in _walk(engine, walked):
            plan = walked.plan
            assert plan is not None
            if group == 0:
                yield plan.header(metadata_for(plan))
            sources = opened.fields()
            for run in plan.runs[group]:
                src = sources[run.field].narrow(0, run.source_offset, run.length).detach()
                if src.device.type == "cpu" and src.dtype == torch.float32 and src.is_contiguous():
                    yield src.numpy()
                    continue
                if stage is None:
                    stage = torch.empty(STAGE_ELEMENTS, dtype=torch.float32, pin_memory=src.is_cuda)
                for lo in range(0, run.length, STAGE_ELEMENTS):
                    n = min(STAGE_ELEMENTS, run.length - lo)
                    stage[:n].copy_(src.narrow(0, lo, n))
                    yield stage[:n].numpy()
        if walked.plan is not None and not walked.plan.runs:
            yield walked.plan.header(metadata_for(walked.plan))


def scalars_now(engine: Any) -> dict[str, Any]:
    """The rank's scalar state (optimizer step and scalars, loss scaler) read without copying a tensor."""
    found = Walked()
    for _ in _walk(engine, found):
        pass
    return found.scalars
