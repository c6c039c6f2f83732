"""Where a DeepSpeed engine keeps each rank's fp32 master weights and optimizer state, per ZeRO stage.

An elastic checkpoint stores, for every parameter, slices of its flattened fp32 master weights and
of each elementwise optimizer state (Adam's moments, SGD's momentum, Adagrad's sum, Lion's average)
tagged with global offsets. Each ZeRO stage keeps those in a different place; a layout names, for
one rank, every slice it owns as views into the engine's own tensors:

- ZeRO-3 (`Zero3Layout`): each parameter is partitioned on its own; the fp32 partitions of a
  sub-group are one flat tensor (possibly swapped to NVMe), which is opened group by group.
- ZeRO-1 and ZeRO-2, and bf16 without ZeRO (`FlatPartitionLayout`): the fp32 copies of a parameter
  group are flattened into one buffer and cut into equal partitions, so a parameter may span two
  ranks. DeepSpeed's tensor-fragment mapping (`ds_state.hp_mapping`, what its universal checkpoint
  uses) says which elements of which parameter this rank's partition holds.
- No ZeRO in fp32 (`ReplicatedLayout`): every rank holds every parameter and its state; rank r
  saves the r-th of `world_size` equal slices of each, so the work of saving is shared.

Elementwise state is found by inspection: any tensor in the optimizer's state shaped like the
fp32 tensor it belongs to. Everything else in the state must be a scalar (a step count); a state
that is neither cannot be resharded, and `unreshardable_state` says so by name.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from elastictrain.checkpoint.tensor_slices import saved_names
from elastictrain.compat.deepspeed import optimizer_state as ds_state
from elastictrain.compat.deepspeed.autotp import data_parallel_rank
from elastictrain.compat.deepspeed.swap_buffers import (
    adam_state_in_swap_buffers,
    buffers_without_reading,
    plain_swapper,
)

FP32 = "fp32"  # the field name of the fp32 master weights; optimizer states keep their own names


@dataclass(frozen=True)
class LocalSlice:
    """Elements [start, start+length) of parameter `name`, found at `offset` in its group's tensors."""

    name: str
    start: int
    length: int
    numel: int
    shape: tuple[int, ...]
    offset: int


@dataclass
class OpenGroup:
    """One group's fp32 tensor, its optimizer state, and the slices of parameters inside it.

    `slices` are what this rank saves; `load_slices` what it must fill when loading (the same,
    except where every rank holds whole parameters).
    """

    fp32: torch.Tensor
    state: dict[str, Any]
    slices: list[LocalSlice] = field(default_factory=list)
    load_slices: list[LocalSlice] | None = None

    def to_load(self) -> list[LocalSlice]:
        return self.slices if self.load_slices is None else self.load_slices

    def fields(self) -> dict[str, torch.Tensor]:
        """fp32 and every elementwise optimizer state, each as a tensor shaped like `fp32`."""
        out = {FP32: self.fp32}
        for key, value in self.state.items():
            if isinstance(value, torch.Tensor) and value.shape == self.fp32.shape and value.dim() > 0:
                out[key] = value
        return out


def _is_scalar(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and value.dim() <= 1
    return isinstance(value, int | float) and not isinstance(value, bool)


def unreshardable_state(group: OpenGroup) -> list[str]:
    """State entries that are neither elementwise like the parameters nor scalars."""
    elementwise = group.fields()
    return [k for k, v in group.state.items() if k not in elementwise and v is not None and not _is_scalar(v)]


def scalar_state(group: OpenGroup) -> dict[str, dict[str, Any]]:
    """Scalars of the optimizer state (e.g. Adam's step), with how to rebuild them."""
    out = {}
    elementwise = group.fields()
    for key, value in group.state.items():
        if key in elementwise or not _is_scalar(value):
            continue
        if isinstance(value, torch.Tensor):
            out[key] = {
                "value": float(value.item()),
                "kind": "tensor",
                "dtype": str(value.dtype),
                "on_accelerator": value.device.type != "cpu",  # a record: loading follows its optimizer
            }
        else:
            out[key] = {"value": float(value), "kind": type(value).__name__}
    return out


def rebuild_scalar(spec: dict[str, Any], device: Any) -> Any:
    """A scalar of the optimizer's state as saved, a tensor one on `device` (`scalar_device`)."""
    if spec["kind"] == "tensor":
        dtype = getattr(torch, spec["dtype"].removeprefix("torch."))
        return torch.tensor(spec["value"], dtype=dtype, device=device)
    return int(spec["value"]) if spec["kind"] == "int" else float(spec["value"])


def scalar_device(optimizer: Any, existing: Any, params_device: torch.device) -> Any:
    """Where the loading optimizer keeps a scalar tensor such as Adam's step, whatever the saver did.

    torch's fused and capturable Adam read `step` on their parameters' device, the others on the CPU.
    A checkpoint saved on the CPU and resumed on a GPU carried its CPU step into CUDA's fused AdamW,
    which refused it ("state_steps is on cpu, different from other tensors on cuda:0").
    """
    if isinstance(existing, torch.Tensor):
        return existing.device
    groups = getattr(optimizer, "param_groups", None) or []
    on_params = any(g.get("fused") or g.get("capturable") for g in groups)
    return params_device if on_params else torch.device("cpu")


def _zero_outside(tensor: torch.Tensor, slices: list[LocalSlice]) -> None:
    """Zero the elements of a group's flat `tensor` that no slice covers (each parameter's partition
    padding), as a swap-in of what the build wrote would have them."""
    end = 0
    for piece in sorted(slices, key=lambda p: p.offset):
        if piece.offset > end:
            tensor.narrow(0, end, piece.offset - end).zero_()
        end = max(end, piece.offset + piece.length)
    if end < tensor.numel():
        tensor.narrow(0, end, tensor.numel() - end).zero_()


class Zero3Layout:
    """ZeRO-3: per sub-group flat fp32 partitions, swapped in from NVMe where offloaded."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.optimizer = engine.optimizer
        names = saved_names(engine)
        opt = self.optimizer
        self._slices: list[list[LocalSlice]] = []
        for params in opt.fp16_groups:
            group = []
            for param in params:
                _, offset, partition_numel = opt.grad_position[opt.get_param_id(param)]
                start = ds_state.param_partition_rank(opt, param) * partition_numel
                valid = max(0, min(partition_numel, param.ds_numel - start))
                if valid:
                    shape = tuple(int(d) for d in param.ds_shape)
                    group.append(LocalSlice(names[param], start, valid, int(param.ds_numel), shape, offset))
            self._slices.append(group)

    def num_groups(self) -> int:
        return len(self._slices)

    def load_slices(self) -> list[LocalSlice]:
        """Every slice this rank fills when loading, known without opening (swapping in) a group."""
        return [piece for group in self._slices for piece in group]

    def save_slices(self, group: int) -> list[LocalSlice]:
        """What this rank saves of `group`, known without opening it."""
        return self._slices[group]

    @contextmanager
    def open(self, group: int, *, write_back: bool, overwrite: bool = False) -> Iterator[OpenGroup]:
        """The group's tensors, swapped in from NVMe where offloaded, and out again on leaving.

        `overwrite`: the caller fills every element of every slice of the fp32 master and the state (a
        load): a sub-group swapped by DeepSpeed's plain swapper is then not read in but given its swap
        buffers, the elements outside the slices zeroed and CPU Adam's state created in them
        (compat/deepspeed/swap_buffers.py); a restoring build leaves its swap files unwritten for this
        (compat/deepspeed/zero3_build.py)."""
        opt = self.optimizer
        swappable = ds_state.swappable(opt, group)
        in_buffers = swappable and overwrite and write_back and plain_swapper(opt)
        if in_buffers:
            buffers_without_reading(opt, group)
            adam_state_in_swap_buffers(opt, group)
        elif swappable:
            ds_state.swap_in(opt, group)
        flat = opt.fp32_partitioned_groups_flat[group]
        opened = OpenGroup(flat, opt.optimizer.state[flat], self._slices[group])
        try:
            if in_buffers:  # what the buffers held before is not this group's: no slice overwrites it
                for tensor in opened.fields().values():
                    _zero_outside(tensor, opened.slices)
            yield opened
            if write_back:
                # fp32 master -> the low-precision partitions the forward pass uses (or their NVMe swap).
                ds_state.write_back_partitions(opt, group)
        finally:
            if swappable:
                if write_back:
                    ds_state.swap_out(opt, group)
                else:
                    ds_state.release_swap_buffers(opt, group)

    def before_load(self) -> None:
        ds_state.partition_all_parameters(self.optimizer)

    def after_load(self, reader: Any) -> None:
        opt = self.optimizer
        # Small parameters stay gathered on every rank ("persistent"): refresh them from the partitions.
        opt.invalidate_secondary_tensor()
        if opt.persistent_parameters:
            opt.persistent_parameters[0].all_gather(opt.persistent_parameters)


class FlatPartitionLayout:
    """ZeRO-1/2 (and DeepSpeed's bf16 optimizer): a partition of each group's flattened fp32 copy."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.optimizer = engine.optimizer
        inner = self.optimizer.optimizer
        self._flats = [g["params"][0] for g in inner.param_groups]
        self._names = saved_names(engine)
        if hasattr(self.optimizer, "round_robin_bit16_groups"):
            self._slices = self._from_flat_layout(self._names)
        else:
            self._slices = self._from_fragment_mapping(self._names)

    def _from_flat_layout(self, names: dict[Any, str]) -> list[list[LocalSlice]]:
        """ZeRO-1/2: each parameter's offset in the flat buffer, cut at this rank's partition.

        Read from the buffer's own layout rather than the fragment mapping: with `round_robin_gradients`
        and no alignment padding, DeepSpeed 0.19 links the mapping in the parameters' original order
        while the buffer holds them reordered, so the mapping names the wrong elements.
        """
        import deepspeed.comm as dist

        opt = self.optimizer
        out: list[list[LocalSlice]] = []
        for i, params in enumerate(opt.round_robin_bit16_groups):
            world = dist.get_world_size(group=opt.real_dp_process_group[i])
            rank = dist.get_rank(group=opt.real_dp_process_group[i])
            size = opt.bit16_groups_flat[i].numel() // world
            lo, hi = rank * size, (rank + 1) * size
            group = []
            for param, offset in zip(params, opt.round_robin_bit16_offsets[i], strict=True):
                start, end = max(offset, lo), min(offset + param.numel(), hi)
                if start < end and param in names:
                    shape = tuple(int(d) for d in param.shape)
                    group.append(
                        LocalSlice(
                            names[param], start - offset, end - start, param.numel(), shape, start - lo
                        )
                    )
            out.append(group)
        return out

    def _from_fragment_mapping(self, names: dict[Any, str]) -> list[list[LocalSlice]]:
        """DeepSpeed's bf16 optimizer: its tensor-fragment mapping (`ds_state.hp_mapping`)."""
        out: list[list[LocalSlice]] = [[] for _ in self._flats]
        for param, name in names.items():
            mapping = ds_state.hp_mapping(param)
            if mapping is None:
                continue  # no element of this parameter lives in this rank's partition
            lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
            shape = tuple(int(d) for d in param.shape)
            out[mapping.param_group_index].append(
                LocalSlice(name, int(lp.start), int(lp.numel), param.numel(), shape, int(hp.start))
            )
        return out

    def num_groups(self) -> int:
        return len(self._flats)

    def load_slices(self) -> list[LocalSlice]:
        return [piece for group in self._slices for piece in group]

    def save_slices(self, group: int) -> list[LocalSlice]:
        return self._slices[group]

    @contextmanager
    def open(self, group: int, *, write_back: bool, overwrite: bool = False) -> Iterator[OpenGroup]:
        flat = self._flats[group]
        yield OpenGroup(flat, self.optimizer.optimizer.state[flat], self._slices[group])

    def before_load(self) -> None:
        pass

    def after_load(self, reader: Any) -> None:
        # Every rank holds every low-precision parameter in these stages: set each from the full fp32
        # weights (what DeepSpeed's step does with an all-gather), so no collective is needed here.
        with torch.no_grad():
            for param, name in self._names.items():
                if reader.has(name):
                    param.data.copy_(reader.full(name, FP32).to(param.dtype))
        # The optimizer reads state through fragment views it links lazily; make it relink them.
        ds_state.relink_optimizer_states(self.optimizer)


class ReplicatedLayout:
    """No ZeRO, fp32: the optimizer works on the parameters themselves, whole on every rank."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.optimizer = engine.optimizer
        # The ranks of one tensor-parallel slice split it: this rank's place among them.
        rank = data_parallel_rank(engine)
        world = engine.dp_world_size if hasattr(engine, "dp_world_size") else 1
        self._params: list[tuple[torch.Tensor, LocalSlice]] = []
        for param, name in saved_names(engine).items():
            if not param.requires_grad:
                continue
            n = param.numel()
            part = math.ceil(n / world)
            start = rank * part
            length = max(0, min(part, n - start))
            shape = tuple(int(d) for d in param.shape)
            self._params.append((param, LocalSlice(name, start, length, n, shape, start)))

    def num_groups(self) -> int:
        return len(self._params)

    def load_slices(self) -> list[LocalSlice]:
        return [_whole(piece) for _, piece in self._params]

    def save_slices(self, group: int) -> list[LocalSlice]:
        piece = self._params[group][1]
        return [piece] if piece.length else []

    @contextmanager
    def open(self, group: int, *, write_back: bool, overwrite: bool = False) -> Iterator[OpenGroup]:
        param, piece = self._params[group]
        flat = param.data.view(-1)
        state = self.optimizer.state[param]
        # Elementwise state is viewed flat, like the parameter; writes go to the optimizer's tensors.
        view = {
            k: (v.view(-1) if isinstance(v, torch.Tensor) and v.shape == param.shape else v)
            for k, v in state.items()
        }
        holder = _FlatState(state, param.shape, view)
        yield OpenGroup(flat, holder, [piece] if piece.length else [], load_slices=[_whole(piece)])

    def before_load(self) -> None:
        pass

    def after_load(self, reader: Any) -> None:
        pass


def _whole(piece: LocalSlice) -> LocalSlice:
    """All of a parameter: what every rank loads when every rank holds every parameter."""
    return LocalSlice(piece.name, 0, piece.numel, piece.numel, piece.shape, 0)


class _FlatState(dict):  # type: ignore[type-arg]
    """The optimizer state of one parameter seen flat; entries added here land in the real state."""

    def __init__(self, real: dict[str, Any], shape: torch.Size, view: dict[str, Any]) -> None:
        super().__init__(view)
        self._real, self._shape = real, shape

    def __setitem__(self, key: str, value: Any) -> None:
        if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == math.prod(self._shape):
            self._real[key] = value.view(self._shape)
        else:
            self._real[key] = value
        super().__setitem__(key, value)


def layout_for(engine: Any) -> Zero3Layout | FlatPartitionLayout | ReplicatedLayout:
    optimizer = engine.optimizer
    if optimizer is None or not hasattr(optimizer, "param_groups") and not hasattr(optimizer, "optimizer"):
        raise RuntimeError("elastic checkpoints need an optimizer; this engine has none")
    if hasattr(optimizer, "fp32_partitioned_groups_flat"):
        return Zero3Layout(engine)
    if any(ds_state.hp_mapping(p) is not None for p in engine.module.parameters()) or hasattr(
        optimizer, "single_partition_of_fp32_groups"
    ):
        return FlatPartitionLayout(engine)
    if isinstance(optimizer, torch.optim.Optimizer):
        return ReplicatedLayout(engine)
    raise RuntimeError(
        f"elastic checkpoints do not support DeepSpeed's {type(optimizer).__name__} "
        "(fp16 or bf16 without ZeRO); use ZeRO stage 1-3, or fp32"
    )
