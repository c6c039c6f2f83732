"""Build a ZeRO-3 engine without the collectives whose results DeepSpeed (0.19) throws away.

Building an engine is on the critical path of every restart: a replaced worker's rank, and every
survivor's, builds one before the first step after a failure or a resize. Two of its steps move
every parameter between the ranks for nothing:

- the optimizer gathers each parameter whole, and partitions it again, only to register its gradient
  hook (`create_reduce_and_remove_grad_hooks`). Since torch 2.1 DeepSpeed registers that hook with
  `register_post_accumulate_grad_hook`, on the Parameter object, which needs none of its values.
  On 2 CPU ranks at 374M parameters: 2.3 s of an 8-10 s build.
- zero.Init broadcasts each parameter from rank 0 as it is created (`_zero_init_param`), so that every
  rank starts from the same values. An attempt that loads every parameter next (a restart, a resize,
  a resume of a built-in model: `hf_init.skip_parameter_init` does not compute them either) overwrites
  them; persistent parameters, kept whole on every rank, are gathered again from the loaded partitions
  (`checkpoint/zero_layouts.py`). 1.4 s at 374M.

With the optimizer's state on NVMe, a third step moves bytes for nothing: `initialize_optimizer_states`
reads each sub-group's fp32 master in from its swap file and writes it back unchanged, only to give it
a gradient buffer it drops again (a round trip of 4 bytes per parameter of a rank's share each way:
2 GB read and 2 GB written per rank at 1B on 2 ranks). `optimizer_states_initialized_without_swapping`
lets it take and release the swap buffers without the I/O.

A restoring build (an attempt that loads every parameter and its state next) moves more: it writes each
sub-group's fp32 master into its swap file, which the load would read back in only to overwrite it.
`fp32_masters_left_for_the_load` records the swap files without writing them; the load then fills each
sub-group in its swap buffers and writes it once (checkpoint/zero_layouts.py): 1.9 GB a rank less written
and read at 1B on 2 ranks (set-up 29.8 s -> 21.8 s).

`hooks_registered_without_gathering`, `parameters_partitioned_without_broadcast`,
`optimizer_states_initialized_without_swapping` and `fp32_masters_left_for_the_load` skip them;
everything else about the build, and every value it produces, is DeepSpeed's own.

One more keeps the build's peak memory down: the optimizer first copies each parameter's partition
into one flat buffer per sub-group and frees the originals, one piece per parameter (4 bytes per
parameter of a rank's share in fp32). The workers' malloc keeps freed pages for reuse, but the large
buffers allocated next (NVMe swap buffers, the flat gradient buffer, Adam's moments) cannot be cut
from those pieces: both were resident at once. `freed_partitions_returned` gives them back as soon as
they are freed (at 350M with NVMe offload the build's peak fell from 3.66 to 2.96 GiB per rank).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any
from unittest import mock

from elastictrain.compat.deepspeed.swap_buffers import (
    SWAP_BUFFERS,
    buffers_without_reading,
    plain_swapper,
    release_without_writing,
)
from elastictrain.compat.registry import active, first_problem, has_attributes, has_parameters, patch


def _stage3() -> Any:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    return DeepSpeedZeroOptimizer_Stage3


def _unchanged(*args: Any, **kwargs: Any) -> Any:
    return nullcontext()


def _skip(*args: Any, **kwargs: Any) -> None:
    return None


def _check_hooks() -> str | None:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.utils.torch import required_torch_version

    if not required_torch_version(min_version=2.1):
        return "torch < 2.1: DeepSpeed registers gradient hooks on a gathered parameter's view"
    return first_problem(
        has_parameters(_stage3().create_reduce_and_remove_grad_hooks, "self"),
        has_attributes(ZeroParamStatus, "NOT_AVAILABLE"),
    )


@patch(
    "grad_hooks_without_gather",
    package="deepspeed",
    kind="performance",
    check=_check_hooks,
    otherwise=_unchanged,
    gains=(
        "recovery time: every parameter is no longer gathered to register hooks: 2.3 s of an 8-10 s engine "
        "build at 374M on 2 CPU ranks, at each restart and resize"
    ),
)
@contextmanager
def hooks_registered_without_gathering() -> Iterator[None]:
    """While active, a ZeRO-3 optimizer's construction registers its gradient hooks on the partitioned
    parameters as they are, without gathering each one whole and partitioning it again.

    What: `DeepSpeedZeroOptimizer_Stage3.create_reduce_and_remove_grad_hooks` runs with each partitioned
    parameter's `all_gather` and `partition` replaced by no-ops (restored after).
    Why: DeepSpeed registers the hook with `register_post_accumulate_grad_hook` on the Parameter (torch
    >= 2.1), which needs none of its values; the gather moved every parameter between the ranks for
    nothing, 2.3 s of an 8-10 s build at 374M on 2 CPU ranks (the module's docstring).
    Retired by: DeepSpeed skipping the gather where the hook is registered on the Parameter itself; no
    upstream issue found.
    """
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    original = DeepSpeedZeroOptimizer_Stage3.create_reduce_and_remove_grad_hooks

    def create_hooks(self: Any) -> None:
        # Only parameters that are partitioned now: gathering and partitioning them again is a round
        # trip back to where they are. Any other one goes through DeepSpeed's own calls.
        partitioned = [
            p for group in self.fp16_groups for p in group if p.ds_status == ZeroParamStatus.NOT_AVAILABLE
        ]
        # zero.Init set both as attributes of each parameter (closures over its Init): swap, then restore.
        saved = [(param, param.all_gather, param.partition) for param in partitioned]
        for param in partitioned:
            param.all_gather, param.partition = _skip, _skip
        try:
            original(self)
        finally:
            for param, all_gather, partition in saved:
                param.all_gather, param.partition = all_gather, partition

    with mock.patch.object(
        DeepSpeedZeroOptimizer_Stage3, "create_reduce_and_remove_grad_hooks", create_hooks
    ):
        yield


def _check_flatten() -> str | None:
    return has_parameters(_stage3()._create_fp16_partitions_with_defragmentation, "self", "fp16_param_groups")


@patch(
    "freed_partitions_returned",
    package="deepspeed",
    kind="memory",
    check=_check_flatten,
    otherwise=_unchanged,
    gains="memory: the engine build's peak 3.66 -> 2.96 GiB per rank at 350M with NVMe offload",
)
@contextmanager
def freed_partitions_returned() -> Iterator[None]:
    """While active, a ZeRO-3 optimizer returns the memory of the per-parameter partitions it has just
    flattened (see the module's docstring) before it allocates anything else.

    What: `DeepSpeedZeroOptimizer_Stage3._create_fp16_partitions_with_defragmentation` is followed by a
    malloc purge (`host.memory.release_freed_memory`).
    Why: the pieces it frees cannot be reused by the large buffers allocated next; both were resident at
    once (the build's peak fell from 3.66 to 2.96 GiB per rank at 350M with NVMe offload).
    Retired by: DeepSpeed allocating the flat buffers before the pieces are freed, or a hook after the
    flattening; no upstream issue found.
    """
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    from elastictrain.host.memory import release_freed_memory

    original = DeepSpeedZeroOptimizer_Stage3._create_fp16_partitions_with_defragmentation

    def flatten(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        release_freed_memory()
        return result

    with mock.patch.object(
        DeepSpeedZeroOptimizer_Stage3, "_create_fp16_partitions_with_defragmentation", flatten
    ):
        yield


def _check_init() -> str | None:
    from deepspeed.runtime.zero.partition_parameters import Init

    return first_problem(
        has_parameters(Init._zero_init_param, "self", "param"),
        has_parameters(Init._convert_to_deepspeed_param, "self", "param"),
    )


@patch(
    "partition_without_broadcast",
    package="deepspeed",
    kind="performance",
    check=_check_init,
    otherwise=_unchanged,
    gains=(
        "recovery time: a restoring build broadcasts no values the load overwrites: 1.4 s of the build at "
        "374M on 2 CPU ranks"
    ),
)
@contextmanager
def parameters_partitioned_without_broadcast() -> Iterator[None]:
    """While active, zero.Init partitions each new parameter without first making it rank 0's values.

    What: `zero.Init._zero_init_param` becomes `_convert_to_deepspeed_param` then `param.partition()`,
    without its broadcast from rank 0.
    Why: only used for a model whose every parameter is loaded before it is used (see the module's
    docstring): the broadcast's values are overwritten, 1.4 s of a build at 374M. The ranks' partitions
    are whatever their memory held until the load overwrites them.
    Retired by: a zero.Init option to skip the broadcast for models loaded next; no upstream issue found.
    """
    from deepspeed.runtime.zero.partition_parameters import Init

    def partition_as_is(self: Any, param: Any) -> None:
        self._convert_to_deepspeed_param(param)
        param.partition()

    with mock.patch.object(Init, "_zero_init_param", partition_as_is):
        yield


def _check_states() -> str | None:
    stage3 = _stage3()
    return first_problem(
        has_parameters(stage3.initialize_optimizer_states, "self"),
        has_parameters(stage3._optimizer_states_and_gradient_swap_in, "self", "sub_group_id", "timer_names"),
        has_parameters(stage3._optimizer_states_and_gradient_swap_out, "self", "sub_group_id", "timer_names"),
        None if active(SWAP_BUFFERS) else f"needs patch {SWAP_BUFFERS}",
    )


@patch(
    "optimizer_states_without_swap_io",
    package="deepspeed",
    kind="performance",
    check=_check_states,
    otherwise=_unchanged,
    gains=(
        "recovery time (NVMe offload): the build's swap-in/out round trip is skipped: 2 GB read and 2 GB "
        "written a rank less at 1B on 2 ranks"
    ),
)
@contextmanager
def optimizer_states_initialized_without_swapping() -> Iterator[None]:
    """While active, a ZeRO-3 optimizer whose state is swapped to NVMe initializes it without reading
    each sub-group in and writing it back unchanged (see the module's docstring).

    What: `initialize_optimizer_states` runs with the instance's `_optimizer_states_and_gradient_swap_in`
    and `_swap_out` replaced by `buffers_without_reading` and `release_without_writing`
    (compat/deepspeed/swap_buffers.py).
    Why: the round trip reads each sub-group's fp32 master only to give it a gradient buffer it drops
    again: 2 GB read and 2 GB written per rank at 1B on 2 ranks.
    Only with DeepSpeed's plain partitioned swapper and the parameters in memory: a pipelined swapper,
    parameters swapped to NVMe, or Muon (whose momentum is created between the two) go through
    DeepSpeed's own calls.
    Retired by: DeepSpeed initializing swapped optimizer state without swapping it in (the state it
    creates is zeros); no upstream issue found.
    """
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    original = DeepSpeedZeroOptimizer_Stage3.initialize_optimizer_states

    def initialize(self: Any) -> None:
        if not plain_swapper(self):
            original(self)
            return
        swap_in, swap_out = partial(buffers_without_reading, self), partial(release_without_writing, self)
        with (
            mock.patch.object(self, "_optimizer_states_and_gradient_swap_in", swap_in),
            mock.patch.object(self, "_optimizer_states_and_gradient_swap_out", swap_out),
        ):
            original(self)

    with mock.patch.object(DeepSpeedZeroOptimizer_Stage3, "initialize_optimizer_states", initialize):
        yield


def _check_masters() -> str | None:
    from deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper import PartitionedOptimizerSwapper

    return first_problem(
        has_parameters(_stage3()._create_fp32_partitions, "self"),
        has_parameters(PartitionedOptimizerSwapper._get_swap_paths, "self", "parameters", "num_elems"),
        has_parameters(
            PartitionedOptimizerSwapper.initialize_parameters, "self", "parameters", "src_tensors"
        ),
        # The load must then fill the swap buffers without reading the files left unwritten.
        None if active(SWAP_BUFFERS) else f"needs patch {SWAP_BUFFERS}",
    )


@patch(
    "fp32_masters_left_for_the_load",
    package="deepspeed",
    kind="performance",
    check=_check_masters,
    otherwise=_unchanged,
    gains=(
        "recovery time (NVMe offload): a restoring build writes no fp32 master the load overwrites: 1.9 GB a"
        " rank less at 1B on 2 ranks, set-up 29.8 -> 21.8 s with the load's single write"
    ),
)
@contextmanager
def fp32_masters_left_for_the_load() -> Iterator[None]:
    """While active, a ZeRO-3 optimizer whose state is swapped to NVMe records each sub-group's swap
    files without writing its fp32 master into them.

    What: `DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions` runs with the swapper's
    `initialize_parameters` replaced by its `_get_swap_paths` (the files are recorded, not written).
    Why: only for a restoring build: its loader fills every sub-group whole without reading its files
    and writes them then (`Zero3Layout.open(..., overwrite=True)`, checkpoint/zero_layouts.py), so the
    master the build would write (from partitions the load overwrites) is never read: 4 bytes per
    parameter of a rank's share (1.9 GB per rank at 1B on 2 ranks) not written. Only with DeepSpeed's
    plain partitioned swapper and the parameters in memory (`plain_swapper`), as the loader.
    Retired by: DeepSpeed deferring the swap files' first write to the first swap-out; no upstream
    issue found.
    """
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    original = DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions

    def create(self: Any) -> None:
        if not plain_swapper(self):
            original(self)
            return
        swapper = self.optimizer_swapper

        def record_only(parameters: list[Any], src_tensors: list[Any]) -> None:
            swapper._get_swap_paths(parameters=parameters, num_elems=[src.numel() for src in src_tensors])

        with mock.patch.object(swapper, "initialize_parameters", record_only):
            original(self)

    with mock.patch.object(DeepSpeedZeroOptimizer_Stage3, "_create_fp32_partitions", create):
        yield
