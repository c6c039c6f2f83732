"""Where elastic checkpoints read and write a DeepSpeed optimizer's state: the private methods and
attributes checkpoint/zero_layouts.py and checkpoint/swap_stream.py reach through, each behind a function
of this module, so that checkpoint/ itself names none.

Not patches (nothing is replaced): internals elastictrain depends on, declared and checked like patches.
A checkpoint written or loaded wrongly is silent corruption, so the ZeRO layouts are "correctness":
outside the tested range elastictrain refuses to start. Reading the NVMe swap files beside the next step
is a time saving: where it does not apply, the rank copies its state instead.
"""

from __future__ import annotations

from typing import Any

from elastictrain.compat.registry import (
    first_problem,
    has_attributes,
    has_fields,
    has_parameters,
    part_of,
    patch,
)

ZERO3_STATE, FLAT_STATE, SWAP_FILES = (
    "zero3_optimizer_state_access",
    "flat_partition_state_access",
    "nvme_swap_files_read",
)


def _check_zero3() -> str | None:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    return first_problem(
        has_parameters(Stage3._get_param_partition_rank, "self", "param"),
        has_parameters(Stage3._swappable_optimizer_subgroup, "self", "sub_group_id"),
        has_parameters(Stage3._optimizer_states_and_gradient_swap_in, "self", "sub_group_id"),
        has_parameters(Stage3._optimizer_states_and_gradient_swap_out, "self", "sub_group_id"),
        has_parameters(Stage3._release_swap_buffers, "self", "sub_group_id"),
        has_parameters(Stage3._reassign_or_swap_out_partitioned_parameters, "self", "sub_group_id"),
        has_parameters(Stage3._partition_all_parameters, "self"),
        has_parameters(Stage3.get_param_id, "self", "param"),
        has_attributes(Stage3, "invalidate_secondary_tensor"),
    )


@patch(
    ZERO3_STATE,
    package="deepspeed",
    kind="correctness",
    check=_check_zero3,
    gains="correctness: elastic ZeRO-3 checkpoints are saved per rank and resharded online to any world size",
)
def param_partition_rank(opt: Any, param: Any) -> int:
    """Which partition of `param` this rank holds in ZeRO-3 optimizer `opt`
    (`DeepSpeedZeroOptimizer_Stage3._get_param_partition_rank`).

    What: elastic checkpoints read and write each rank's fp32 master and optimizer state sub-group by
    sub-group through ZeRO-3's private methods (this one, `_swappable_optimizer_subgroup`,
    `_optimizer_states_and_gradient_swap_in/out`, `_release_swap_buffers`,
    `_reassign_or_swap_out_partitioned_parameters`, `_partition_all_parameters`); nothing is replaced.
    Why: DeepSpeed's own checkpoints are per world size; an elastic one is resharded to any world size,
    so it must know which slice of which parameter each rank holds and swap its sub-groups in and out.
    Retired by: a public ZeRO-3 API for a rank's partitions and their optimizer state (what DeepSpeed's
    universal checkpoint reads offline); no upstream issue found.
    """
    return int(opt._get_param_partition_rank(param))


@part_of(ZERO3_STATE)
def swappable(opt: Any, group: int) -> bool:
    """Whether sub-group `group` lives in NVMe swap files between updates."""
    return bool(opt._swappable_optimizer_subgroup(group))


@part_of(ZERO3_STATE)
def swap_in(opt: Any, group: int) -> None:
    """Read sub-group `group`'s fp32 master and optimizer state in from its swap files."""
    opt._optimizer_states_and_gradient_swap_in(group)


@part_of(ZERO3_STATE)
def swap_out(opt: Any, group: int) -> None:
    """Write sub-group `group` to its swap files and release its buffers."""
    opt._optimizer_states_and_gradient_swap_out(group)


@part_of(ZERO3_STATE)
def release_swap_buffers(opt: Any, group: int) -> None:
    """Release sub-group `group`'s swap buffers without writing them."""
    opt._release_swap_buffers(group)


@part_of(ZERO3_STATE)
def write_back_partitions(opt: Any, group: int) -> None:
    """fp32 master -> the low-precision partitions the forward pass uses (or their NVMe swap)."""
    opt._reassign_or_swap_out_partitioned_parameters(group)


@part_of(ZERO3_STATE)
def partition_all_parameters(opt: Any) -> None:
    """Release every gathered parameter to its partition (before a load writes the partitions)."""
    opt._partition_all_parameters()


def _check_flat() -> str | None:
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed.utils.tensor_fragment import tensor_fragment

    return first_problem(
        has_parameters(DeepSpeedZeroOptimizer._link_all_hp_params, "self"),
        has_fields(tensor_fragment, "lp_fragment_address", "hp_fragment_address", "param_group_index"),
    )


@patch(
    FLAT_STATE,
    package="deepspeed",
    kind="correctness",
    check=_check_flat,
    gains="correctness: elastic checkpoints of ZeRO-1/2 and bf16 runs reshard online to another world size",
)
def hp_mapping(param: Any) -> Any:
    """DeepSpeed's tensor-fragment mapping of `param` (`param._hp_mapping`): which elements of it this
    rank's fp32 partition holds, or None (ZeRO-1/2, bf16 without ZeRO).

    What: elastic checkpoints read `_hp_mapping` (as DeepSpeed's universal checkpoint does) and, after a
    load, set the optimizer's `_hp_optimizer_states_linked` to False so that it relinks its fragment
    views of the optimizer state (`relink_optimizer_states`); nothing else is replaced.
    Why: a ZeRO-1/2 or bf16 partition cuts parameters anywhere; the mapping says where.
    Retired by: a public accessor for the fragment mapping and a public relink after a state load; no
    upstream issue found.
    """
    return getattr(param, "_hp_mapping", None)


@part_of(FLAT_STATE)
def relink_optimizer_states(opt: Any) -> None:
    """Make a ZeRO-1/2 or bf16 optimizer relink its fragment views of the state at its next step."""
    if hasattr(opt, "_hp_optimizer_states_linked"):
        opt._hp_optimizer_states_linked = False


def _check_swap_files() -> str | None:
    from deepspeed.runtime.swap_tensor.optimizer_utils import OptimizerSwapper, SwapTensorContext

    context = has_parameters(SwapTensorContext.__init__, "self", "tensor", "swap_folder")
    return first_problem(has_parameters(OptimizerSwapper.parameter_id, "param"), context)


@patch(
    SWAP_FILES,
    package="deepspeed",
    kind="performance",
    check=_check_swap_files,
    otherwise=lambda *a: None,
    gains=(
        "design: a checkpoint of NVMe-swapped optimizer state is written from the swap files beside the next"
        " step, not through the step's buffers"
    ),
)
def swap_file_paths(opt: Any, flat: Any) -> dict[int, str] | None:
    """The swap file of each tensor of the sub-group whose fp32 master is `flat` (id of the tensor ->
    path), read from the plain swapper's records; None where it has none (the caller copies instead).

    What: reads `optimizer_swapper.swap_params_info[parameter_id(flat)].tensors[*].swap_path`.
    Why: a checkpoint of NVMe-swapped state is written from the files beside the next step, without
    DeepSpeed's swap-in (which would take the step's buffers and aio handle).
    Retired by: a public DeepSpeed API naming a sub-group's swap files; no upstream issue found.
    """
    swapper = opt.optimizer_swapper
    info = swapper.swap_params_info.get(swapper.parameter_id(flat))
    if info is None:
        return None
    return {id(t.compute_tensor): t.swap_path for t in info.tensors}
