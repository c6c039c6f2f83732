"""Read and write a ZeRO-3 engine's state as world-size-independent fragments.

Each rank owns, for every parameter, one contiguous slice of the flattened parameter (ZeRO-3
partitions each parameter across the data-parallel ranks). We save that slice of the fp32 master
weights and of both Adam moments, tagged with its global offset. Loading at any world size M then
means: each new rank asks for its own slice and reads exactly those bytes from whichever old files
hold them. There is no conversion step (unlike `ds_to_universal`), and it works when the optimizer
state is swapped to NVMe, because we go through ZeRO-3's own swap-in / swap-out of each sub-group.

This touches DeepSpeed internals of `DeepSpeedZeroOptimizer_Stage3` (fp16_groups, grad_position,
fp32_partitioned_groups_flat, the swap helpers); they are the same ones its universal-checkpoint
loader uses. Tested against the installed version by the reshard tests.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FIELDS = ("fp32", "exp_avg", "exp_avg_sq")
FRAGMENTS_KEY = "elastictrain.fragments"


@dataclass(frozen=True)
class Fragment:
    """Elements [start, start+length) of a flattened parameter of `numel` elements and `shape`."""

    start: int
    length: int
    numel: int
    shape: tuple[int, ...]


def _stage3_optimizer(engine: Any) -> Any:
    optimizer = engine.optimizer
    if not hasattr(optimizer, "fp32_partitioned_groups_flat"):
        raise RuntimeError(
            "elastic checkpoints need ZeRO stage 3 (deepspeed.zero_stage=3); "
            f"this engine runs {type(optimizer).__name__}"
        )
    return optimizer


@contextmanager
def _sub_group(
    optimizer: Any, group: int, *, write_back: bool
) -> Iterator[tuple[torch.Tensor, dict[str, Any]]]:
    """The fp32 flat partition and optimizer state of one sub-group, swapped in from NVMe if needed."""
    swappable = optimizer._swappable_optimizer_subgroup(group)
    if swappable:
        optimizer._optimizer_states_and_gradient_swap_in(group)
    flat = optimizer.fp32_partitioned_groups_flat[group]
    try:
        yield flat, optimizer.optimizer.state[flat]
        if write_back:
            # fp32 master -> the low-precision partitions the forward pass uses (or their NVMe swap).
            optimizer._reassign_or_swap_out_partitioned_parameters(group)
    finally:
        if swappable:
            if write_back:
                optimizer._optimizer_states_and_gradient_swap_out(group)
            else:
                optimizer._release_swap_buffers(group)


def _local_slices(engine: Any) -> Iterator[tuple[int, str, Any, int, int, int]]:
    """(sub_group, name, param, offset in the flat partition, global start, valid length) per parameter."""
    optimizer = _stage3_optimizer(engine)
    names = {param: name for name, param in engine.module.named_parameters()}
    for group, params in enumerate(optimizer.fp16_groups):
        for param in params:
            _, offset, partition_numel = optimizer.grad_position[optimizer.get_param_id(param)]
            start = optimizer._get_param_partition_rank(param) * partition_numel
            valid = max(0, min(partition_numel, param.ds_numel - start))
            yield group, names[param], param, offset, start, valid


@torch.no_grad()
def snapshot_local_state(engine: Any) -> tuple[dict[str, torch.Tensor], dict[str, Fragment], dict[str, Any]]:
    """This rank's fragments as CPU tensors named 'param::field', their positions, and scalar state."""
    optimizer = _stage3_optimizer(engine)
    tensors: dict[str, torch.Tensor] = {}
    fragments: dict[str, Fragment] = {}
    step_count: float | None = None
    slices = list(_local_slices(engine))
    for group in range(len(optimizer.fp16_groups)):
        with _sub_group(optimizer, group, write_back=False) as (flat, state):
            if step_count is None and "step" in state:
                step_count = float(state["step"])
            for g, name, param, offset, start, valid in slices:
                if g != group or valid == 0:
                    continue
                sources = {"fp32": flat, "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
                for field in FIELDS:
                    tensors[f"{name}::{field}"] = (
                        sources[field].narrow(0, offset, valid).detach().to("cpu", copy=True)
                    )
                fragments[name] = Fragment(
                    start, valid, int(param.ds_numel), tuple(int(d) for d in param.ds_shape)
                )
    scalars: dict[str, Any] = {"optimizer_step": step_count}
    scaler = getattr(optimizer, "loss_scaler", None)
    if scaler is not None:
        scalars["loss_scaler"] = {
            k: float(v)
            for k, v in vars(scaler).items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
    return tensors, fragments, scalars


def fragments_metadata(fragments: dict[str, Fragment]) -> str:
    return json.dumps({n: [f.start, f.length, f.numel, list(f.shape)] for n, f in sorted(fragments.items())})


def parse_fragments_metadata(text: str) -> dict[str, Fragment]:
    return {n: Fragment(s, ln, nm, tuple(sh)) for n, (s, ln, nm, sh) in json.loads(text).items()}


class FragmentReader:
    """Reads any element range of any saved parameter from the fragment files of one checkpoint."""

    def __init__(self, files: list[Path]) -> None:
        from safetensors import safe_open

        self._handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
        # name -> sorted starts, and the (start, length, handle) behind each
        self._index: dict[str, list[tuple[int, int, Any]]] = {}
        self.params: dict[str, Fragment] = {}
        for path, handle in zip(files, self._handles, strict=True):
            meta = handle.metadata() or {}
            if FRAGMENTS_KEY not in meta:
                raise ValueError(f"{path}: not an elastictrain fragment file (no {FRAGMENTS_KEY} metadata)")
            for name, frag in parse_fragments_metadata(meta[FRAGMENTS_KEY]).items():
                self._index.setdefault(name, []).append((frag.start, frag.length, handle))
                self.params[name] = Fragment(0, frag.numel, frag.numel, frag.shape)
        for parts in self._index.values():
            parts.sort(key=lambda p: p[0])

    def read(self, name: str, field: str, start: int, length: int) -> torch.Tensor:
        if name not in self._index:
            raise KeyError(f"parameter {name!r} is not in this checkpoint")
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

    def full(self, name: str, field: str = "fp32") -> torch.Tensor:
        frag = self.params[name]
        return self.read(name, field, 0, frag.numel).view(frag.shape)


@torch.no_grad()
def load_local_state(engine: Any, reader: FragmentReader, scalars: dict[str, Any]) -> None:
    """Fill this rank's partitions (weights, Adam moments, step) from a checkpoint of any world size."""
    optimizer = _stage3_optimizer(engine)
    slices = list(_local_slices(engine))
    missing = sorted({name for _, name, *_ in slices} - set(reader.params))
    if missing:
        raise ValueError(f"checkpoint does not match the model: missing parameters {missing[:5]}")
    for _, name, param, *_ in slices:
        if reader.params[name].numel != param.ds_numel:
            raise ValueError(
                f"checkpoint does not match the model: {name} has {reader.params[name].numel} elements "
                f"in the checkpoint and {param.ds_numel} in the model"
            )
    optimizer._partition_all_parameters()
    step = scalars.get("optimizer_step")
    for group in range(len(optimizer.fp16_groups)):
        with _sub_group(optimizer, group, write_back=True) as (flat, state):
            if "exp_avg" not in state:
                # torch's Adam creates its state on the first step; a fresh engine has none yet.
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(flat)
                state["exp_avg_sq"] = torch.zeros_like(flat)
            targets = {"fp32": flat, "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
            for g, name, _, offset, start, valid in slices:
                if g != group:
                    continue
                for field in FIELDS:
                    part = targets[field].narrow(0, offset, valid)
                    if valid:
                        part.copy_(reader.read(name, field, start, valid).to(part.dtype))
            if step is not None and "step" in state:
                if isinstance(state["step"], torch.Tensor):
                    state["step"].fill_(step)
                else:
                    state["step"] = type(state["step"])(step)
    scaler = getattr(optimizer, "loss_scaler", None)
    for key, value in (scalars.get("loss_scaler") or {}).items():
        if scaler is not None and hasattr(scaler, key):
            setattr(scaler, key, type(getattr(scaler, key))(value))
    # Small parameters stay gathered on every rank ("persistent"): refresh them from the new partitions.
    optimizer.invalidate_secondary_tensor()
    if optimizer.persistent_parameters:
        optimizer.persistent_parameters[0].all_gather(optimizer.persistent_parameters)
