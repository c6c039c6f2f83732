"""A rank's checkpoint file read from ZeRO-3's NVMe swap files, beside the next step.

With the optimizer offloaded to NVMe, each swappable sub-group's fp32 weights and optimizer state live
in one swap file per tensor (`<param id>.tensor.swp`, the data at offset 0) between two updates.
Reading them through DeepSpeed's swap-in would take its swap buffers and aio handle, which the step's
backward also uses (it swaps gradients out), so that read must stop training. Read with plain file
reads instead, the files can be written into the checkpoint while the next step's forward and backward
run: nothing writes them until the next update (which waits for it: worker/snapshots/store.py), and the
host memory used is one read buffer. Sub-groups kept in memory (too small to swap) are read from their
tensors, which the forward and backward do not change either.

Only DeepSpeed's PartitionedOptimizerSwapper (the default) finishes its writes within the update; the
pipelined one (`pipeline_read` or `pipeline_write`) may leave a write in flight: not read this way.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from elastictrain.checkpoint.rank_snapshot import F32, RankFilePlan, finish_scalars, plan_rank_file
from elastictrain.checkpoint.zero_layouts import FP32, OpenGroup, Zero3Layout, layout_for, scalar_state
from elastictrain.compat.deepspeed import optimizer_state as ds_state

READ_BYTES = 64 << 20  # one read buffer: the host memory the write uses


@dataclass(frozen=True)
class GroupSource:
    """Where one sub-group's fields are: swap file paths (swapped) or tensors (kept in memory)."""

    files: dict[str, str]
    tensors: dict[str, torch.Tensor]


@dataclass
class SwapFileStream:
    plan: RankFilePlan
    sources: list[GroupSource]
    scalars: dict[str, Any]

    def chunks(self, metadata: dict[str, str]) -> Iterator[Any]:
        """The file's header, then its data group by group: read from the swap files or the tensors."""
        yield self.plan.header(metadata)
        with torch.no_grad():
            for runs, source in zip(self.plan.runs, self.sources, strict=True):
                for run in runs:
                    if run.field in source.tensors:
                        yield source.tensors[run.field].narrow(0, run.source_offset, run.length).numpy()
                    else:
                        yield from _read(source.files[run.field], run.source_offset * F32, run.length * F32)


def _read(path: str, offset: int, size: int) -> Iterator[bytes]:
    fd = os.open(path, os.O_RDONLY)
    try:
        end = offset + size
        while offset < end:
            data = os.pread(fd, min(READ_BYTES, end - offset), offset)
            if not data:
                raise RuntimeError(f"{path}: ends at byte {offset}, the checkpoint needs {end}")
            offset += len(data)
            yield data
        # The swap file's pages are the step's to cache, not this copy's.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def swap_file_stream(engine: Any, larger_than: float = 0.0) -> SwapFileStream | None:
    """The plan to write this rank's file from the swap files, made without reading or swapping anything
    (call between steps). None where that does not apply: no ZeRO-3 optimizer swapped to NVMe, a swapper
    whose writes may still be in flight, or state of `larger_than` bytes or less (a copy of it fits in
    the memory checkpoints may use: the caller copies it instead)."""
    opt = engine.optimizer
    swapper = getattr(opt, "optimizer_swapper", None)
    if swapper is None or type(swapper).__name__ != "PartitionedOptimizerSwapper":
        return None
    layout = layout_for(engine)
    assert isinstance(layout, Zero3Layout)
    sources: list[GroupSource] = []
    fields: list[str] | None = None
    scalars: dict[str, Any] = {}
    for group, flat in enumerate(opt.fp32_partitioned_groups_flat):
        state = opt.optimizer.state.get(flat, {})
        if ds_state.swappable(opt, group):
            paths = ds_state.swap_file_paths(opt, flat)
            if paths is None:
                return None
            if id(flat) not in paths:
                return None  # the fp32 weights are not where this reader expects them
            files = {FP32: paths[id(flat)]}
            files.update({k: paths[id(v)] for k, v in state.items() if id(v) in paths})
            rest = {k: v for k, v in state.items() if id(v) not in paths}
            source = GroupSource(files, {})
        else:
            with layout.open(group, write_back=False) as opened:
                source = GroupSource({}, dict(opened.fields()))
                rest = {k: v for k, v in state.items() if k not in source.tensors}
        names = [*source.files, *source.tensors]
        if fields is None:
            fields = names
        elif names != fields and layout.save_slices(group):
            return None  # groups unlike each other: the live stream's walk says why
        if not scalars.get("optimizer_state"):
            scalars["optimizer_state"] = scalar_state(OpenGroup(flat, rest))
        sources.append(source)
    plan = plan_rank_file([layout.save_slices(g) for g in range(len(sources))], fields or [FP32])
    if plan.data_bytes <= larger_than:
        return None
    finish_scalars(engine, scalars)
    return SwapFileStream(plan, sources, scalars)
