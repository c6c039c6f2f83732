"""Drop two copies of a rank's partition that DeepSpeed's ZeRO-3 (0.19) keeps when the weights are fp32.

With the optimizer in process memory and fp32 training weights:

- ZeRO-3 means to use the partition the forward pass gathers from as the optimizer's fp32 master
  (`_create_fp32_partitions` aliases them when dtype and device match), but it compares a
  `torch.device` with a device name string, which is never equal in torch 2.x: every rank keeps a
  second fp32 copy of its partition, 4 bytes per parameter of its share, for the whole run;
- before each update it flattens the partition's gradients into a new tensor
  (`_prepare_fp32_grad_for_sub_group`) although they already lie, in order, in one contiguous fp32
  buffer: 4 more bytes per parameter of its share at the step's peak.

`share_fp32_partitions` makes the master the training partition itself and hands the optimizer its
gradients as a view of that buffer.

With the optimizer offloaded, ZeRO-3 keeps its reduced gradient partitions in one flat host buffer
(it puts that buffer on the host whenever the optimizer is offloaded) and, at every update boundary,
copies them into the optimizer's own fp32 gradient buffer (`_offload_grad_partition_at_boundary`):
on a CPU-only machine the same bytes twice, 4 bytes per parameter of a rank's share for the whole run.
`share_offloaded_gradients` makes each sub-group's optimizer gradient a view of its run of the flat
buffer; DeepSpeed's boundary copy then copies a tensor onto itself, which torch skips.

With the optimizer's state swapped to NVMe, DeepSpeed's CPU Adam creates its two moments at the first
step, as new tensors beside the swap buffers it brings each sub-group into (which have room for
them): 8 bytes per element of a sub-group more at that step, at the moment the forward and backward
pass's freed temporaries are still held by the allocator. `create_swapped_adam_state` creates the
moments of a freshly built engine at the build instead, one sub-group at a time, and swaps them out:
from the first step on, each sub-group's moments come in through the swap buffers (a 2-rank 134M
model's first-step peak went from 2.88 to 2.41 GiB per rank, with the build's freed memory returned).

All of these are exact: the values and the update are the same, only the copies are gone. Anything
else (mixed precision, a GPU's device buffers, a layout other than expected) is left to DeepSpeed.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any

from elastictrain.compat.deepspeed.swap_buffers import SWAP_BUFFERS, adam_state_in_swap_buffers
from elastictrain.compat.registry import active, first_problem, has_parameters, patch, shape_mismatch

if TYPE_CHECKING:  # imported where used: the driver's version check imports this module, not torch
    import torch

FP32_SHARED, GRADS_SHARED, ADAM_AT_BUILD = (
    "fp32_partitions_shared",
    "offloaded_gradients_shared",
    "swapped_adam_state_at_build",
)
_STAGE3_FIELDS = ("fp32_partitioned_groups_flat", "fp16_partitioned_groups_flat", "fp16_groups", "optimizer")


def _nothing(*args: Any, **kwargs: Any) -> int:
    return 0


def _stage3_optimizer(engine: Any, patch_name: str) -> Any:
    """The engine's ZeRO-3 optimizer, or None (said once, by `shape_mismatch`, where a ZeRO-3 optimizer
    lacks the fields these patches read)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    opt = engine.optimizer
    if not isinstance(opt, DeepSpeedZeroOptimizer_Stage3):
        return None  # not ZeRO-3 (a stage the caller did not ask about): nothing to share
    missing = [f for f in _STAGE3_FIELDS if not hasattr(opt, f)]
    if missing:
        shape_mismatch(patch_name, f"DeepSpeedZeroOptimizer_Stage3 has no {', '.join(missing)}")
        return None
    return opt


def _check_fp32() -> str | None:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    return has_parameters(
        DeepSpeedZeroOptimizer_Stage3._prepare_fp32_grad_for_sub_group, "self", "sub_group_id"
    )


@patch(
    FP32_SHARED,
    package="deepspeed",
    kind="memory",
    check=_check_fp32,
    otherwise=_nothing,
    gains=(
        "memory: no second fp32 copy of a rank's share (4 bytes a parameter) for the whole run: RSS 536 MB "
        "lower at 134M on one rank; nor the step's flattened gradient copy at its peak"
    ),
)
def share_fp32_partitions(engine: Any) -> int:
    """Alias ZeRO-3's fp32 master to the fp32 training partition and hand out gradient views instead of
    flattened copies; returns the bytes freed per rank (0 where nothing applies).

    What: each sub-group's `fp32_partitioned_groups_flat` tensor takes the data of its
    `fp16_partitioned_groups_flat` partition (fp32 training, optimizer in memory), and the optimizer's
    `_prepare_fp32_grad_for_sub_group` is replaced on the instance by `_prepare_grad_view`.
    Why: `_create_fp32_partitions` means to alias them but compares a `torch.device` with a device name
    (never equal in torch 2.x): 4 bytes per parameter of a rank's share for the whole run, and 4 more at
    the step's peak for the flattened gradient copy.
    Retired by: DeepSpeed comparing devices as `torch.device` in `_create_fp32_partitions` and viewing a
    contiguous gradient run in `_prepare_fp32_grad_for_sub_group`; no upstream issue found.
    """
    opt = _stage3_optimizer(engine, FP32_SHARED)
    if opt is None or getattr(opt, "offload_optimizer", True):
        return 0  # offloaded: the master lives on the host apart from the training partition
    freed = 0
    for group, master in enumerate(opt.fp32_partitioned_groups_flat):
        weights = opt.fp16_partitioned_groups_flat[group]
        if _same_layout(master, weights) and master.data_ptr() != weights.data_ptr():
            if opt.optimizer.state.get(master):
                continue  # built before: only a fresh engine is known to hold equal copies
            freed += master.numel() * master.element_size()
            master.data = weights.data  # the same tensor object: the optimizer's references stay valid
    opt._prepare_fp32_grad_for_sub_group = types.MethodType(_prepare_grad_view, opt)
    return freed


# ZeRO-3 keeps each parameter's view of the flat gradient buffer in a name-mangled private dict.
GRAD_PARTITION_VIEWS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"


def _check_grads() -> str | None:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    return has_parameters(DeepSpeedZeroOptimizer_Stage3._swappable_optimizer_subgroup, "self", "sub_group_id")


@patch(
    GRADS_SHARED,
    package="deepspeed",
    kind="memory",
    check=_check_grads,
    otherwise=_nothing,
    gains=(
        "memory (CPU-only offload): no second fp32 copy of a rank's reduced gradients (4 bytes a parameter) "
        "for the whole run: RSS 536 MB lower at 134M on one rank"
    ),
)
def share_offloaded_gradients(engine: Any, cpu_only: bool) -> int:
    """With the optimizer offloaded on a CPU-only machine, make each in-memory sub-group's fp32 gradient a
    view of ZeRO-3's flat gradient buffer instead of a copy; returns the bytes freed per rank.

    What: each in-memory sub-group's `fp32_partitioned_groups_flat[i].grad` becomes a view of its run of
    the flat buffer, found through the name-mangled `__param_id_to_grad_partition` dict.
    Why: DeepSpeed copies the reduced gradients into the optimizer's own buffer at every boundary
    (`_offload_grad_partition_at_boundary`): on a CPU-only machine the same bytes twice, 4 bytes per
    parameter of a rank's share for the whole run.
    Only where the gradients are computed in host memory (`cpu_only`): on a GPU the boundary copy reads
    a device copy of the buffer, a path this does not touch.
    Retired by: DeepSpeed using the flat buffer as the optimizer's gradient when both are on the host;
    no upstream issue found.
    """
    opt = _stage3_optimizer(engine, GRADS_SHARED)
    if opt is None or not cpu_only or not getattr(opt, "offload_optimizer", False):
        return 0
    views = getattr(opt, GRAD_PARTITION_VIEWS, None)
    if views is None:
        shape_mismatch(GRADS_SHARED, f"DeepSpeedZeroOptimizer_Stage3 has no {GRAD_PARTITION_VIEWS}")
        return 0
    if not views:
        return 0
    freed = 0
    masters = opt.fp32_partitioned_groups_flat
    for group, (params, master) in enumerate(zip(opt.fp16_groups, masters, strict=True)):
        grad = master.grad
        if grad is None or opt._swappable_optimizer_subgroup(group):
            continue  # swapped sub-groups bring their gradients in from NVMe with their state
        run = contiguous_run([views[p.ds_id] for p in params], grad.dtype, grad.numel())
        if run is None or run.device != grad.device or run.data_ptr() == grad.data_ptr():
            continue
        freed += grad.numel() * grad.element_size()
        master.grad = run
    return freed


def _check_adam() -> str | None:
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    return first_problem(
        has_parameters(Stage3._optimizer_states_and_gradient_swap_in, "self", "sub_group_id"),
        has_parameters(Stage3._optimizer_states_and_gradient_swap_out, "self", "sub_group_id"),
        has_parameters(DeepSpeedCPUAdam.__init__, "self", "model_params"),
    )


@patch(
    ADAM_AT_BUILD,
    package="deepspeed",
    kind="memory",
    check=_check_adam,
    otherwise=_nothing,
    gains="memory (NVMe offload): the first step's peak 2.88 -> 2.41 GiB per rank at 134M on 2 ranks",
)
def create_swapped_adam_state(engine: Any) -> int:
    """Create DeepSpeed CPU Adam's state (step 0, zero moments, as its first step would) for every
    sub-group swapped to NVMe that has none yet, in the sub-group's free swap buffers, and swap it out;
    returns the sub-groups given state.

    What: at the build, each swappable sub-group is swapped in (`_optimizer_states_and_gradient_swap_in`),
    given CPU Adam's state in its free swap buffers (compat/deepspeed/swap_buffers.py) and swapped out.
    Why: CPU Adam creates its moments at the first step as new tensors beside the swap buffers, 8 bytes
    per element of a sub-group more at that step's peak (2.88 -> 2.41 GiB per rank at 134M on 2 ranks).
    Only for DeepSpeed's CPU Adam, whose state is known, and its plain (not pipelined) swapper; a
    restoring build leaves it to the loader, which creates and fills it in the same pass.
    Retired by: DeepSpeed's CPU Adam creating swapped state in the swap buffers; no upstream issue found.
    """
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper import PartitionedOptimizerSwapper

    opt = _stage3_optimizer(engine, ADAM_AT_BUILD)
    if opt is None or not getattr(opt, "swap_optimizer", False) or not active(SWAP_BUFFERS):
        return 0
    plain = type(getattr(opt, "optimizer_swapper", None)) is PartitionedOptimizerSwapper  # not pipelined
    if not plain or not isinstance(opt.optimizer, DeepSpeedCPUAdam):
        return 0  # another optimizer or swapper (the user's choice): DeepSpeed creates the state
    created = 0
    for group in range(len(opt.fp16_groups)):
        if not opt._swappable_optimizer_subgroup(group):
            continue
        opt._optimizer_states_and_gradient_swap_in(group)
        created += adam_state_in_swap_buffers(opt, group)
        opt._optimizer_states_and_gradient_swap_out(group)
    return created


def _same_layout(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (
        a is not None
        and b is not None
        and a.numel() > 0
        and a.dtype == b.dtype
        and a.device == b.device
        and a.shape == b.shape
    )


def contiguous_run(tensors: list[torch.Tensor], dtype: torch.dtype, numel: int) -> torch.Tensor | None:
    """One flat view over `tensors` when they lie back to back, in order, in one storage of `dtype`
    and fill `numel` elements; None otherwise."""
    if not tensors:
        return None
    first = tensors[0]
    storage = first.untyped_storage()
    offset = first.storage_offset()
    expected = offset
    for t in tensors:
        if (
            t.dtype != dtype
            or not t.is_contiguous()
            or t.untyped_storage().data_ptr() != storage.data_ptr()
            or t.storage_offset() != expected
        ):
            return None
        expected += t.numel()
    if expected - offset != numel:
        return None
    import torch

    return torch.empty(0, dtype=dtype, device=first.device).set_(storage, offset, (numel,))


def _prepare_grad_view(opt: Any, sub_group_id: int) -> None:
    """ZeRO-3's `_prepare_fp32_grad_for_sub_group`, without the copy when the gradients are already
    one contiguous fp32 run (the update then scales and reads them in place, in the buffer the next
    step's first micro-batch overwrites)."""
    master = opt.fp32_partitioned_groups_flat[sub_group_id]
    view = contiguous_run(opt.averaged_gradients[sub_group_id], master.dtype, master.numel())
    if view is None or view.device != master.device:
        type(opt)._prepare_fp32_grad_for_sub_group(opt, sub_group_id)
        return
    master.grad = view
    opt.averaged_gradients[sub_group_id] = None
