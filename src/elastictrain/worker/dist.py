"""The process group of an attempt inside the actor: how it is left, and the process-wide state
(ZeRO-3's counters, DeepSpeed's shared-memory buffers) that must not leak from one attempt to the next.
"""

from __future__ import annotations

import contextlib
import glob
import os
from typing import Any

from elastictrain.worker.attempt import AttemptSpec
from elastictrain.worker.collective_sockets import CollectiveSockets


def reset_zero_counters() -> None:
    """ZeRO-3 numbers parameters (and counts persisted ones) in process-wide counters; ranks must agree.

    A warm actor has built engines before and a new one has not: without this reset their parameter
    ids differ and ZeRO-3's cross-rank checks fail ("disagreement on list contents").
    """
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partition_parameters import Init, InsertPostInitMethodToModuleSubClasses

    # Module ids come from a mutable default argument, `count=[0]`, shared by every engine built.
    module_counter = DeepSpeedZeRoOffload._register_deepspeed_module.__defaults__
    if module_counter and isinstance(module_counter[0], list):
        module_counter[0][0] = 0
    Init.param_id = 0
    Init.num_persisted_parameters = 0
    Init.num_persisted_elements = 0
    InsertPostInitMethodToModuleSubClasses.num_module_parameters = 0
    InsertPostInitMethodToModuleSubClasses.num_module_elements = 0


def release_engine(engine: Any) -> None:
    """Let a dropped engine be freed, not kept by DeepSpeed beside the next one.

    ZeRO-3 keeps each model it wraps in two process-wide places that nothing empties: the stack of
    modules in forward (`parameter_offload.FWD_MODULE_STACK`, the top module is pushed once and never
    popped) and an unbounded `lru_cache` on a coordinator method, keyed by (coordinator, module). So
    every engine a warm actor built stayed alive through its hooks: a 125M rank held 1.8 GiB more
    per attempt, and at 1B a survivor rebuilding its engine beside a replacement ran the node out of
    memory. No forward runs while an attempt is left, so both are emptied; `destroy()` is DeepSpeed's
    own release (optimizer hooks, buffers).
    """
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as Ppc

    if engine is not None and hasattr(engine, "destroy"):
        with contextlib.suppress(Exception):  # leaving an attempt must not fail on a half-built engine
            engine.destroy()
    parameter_offload.FWD_MODULE_STACK.clear()
    method = getattr(Ppc, "_PartitionedParameterCoordinator__params_to_release", None)
    # The cache sits under DeepSpeed's NVTX wrapper (a closure) or is the method itself.
    for cached in [method, *(c.cell_contents for c in getattr(method, "__closure__", None) or ())]:
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()


def zero_stage(spec: AttemptSpec) -> int:
    return int(spec.ds_config.get("zero_optimization", {}).get("stage", 0))


def abort_collectives(use_gpu: bool, sockets: CollectiveSockets) -> int:
    """Release every collective this rank takes part in, and the peers waiting on it in one.

    NCCL's communicators are aborted (a kernel waiting on a dead peer never returns otherwise); gloo's
    connections are half-closed (worker/collective_sockets.py), so that a collective blocked on this
    rank raises on every peer, and this rank's own raises once they do the same. Returns the number
    of connections closed.
    """
    import torch.distributed as dist

    if use_gpu and dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):  # best effort; destroy still runs
            dist.distributed_c10d._abort_process_group()  # type: ignore[attr-defined]
        return 0
    return sockets.half_close()


def destroy_process_group(use_gpu: bool, sockets: CollectiveSockets) -> None:
    import torch.distributed as dist

    abort_collectives(use_gpu, sockets)  # peers still waiting on this rank must not wait for a timeout
    if dist.is_available() and dist.is_initialized():
        try:
            import deepspeed.comm as ds_comm

            ds_comm.destroy_process_group()  # also releases deepspeed.utils.groups' references
        except Exception:  # noqa: BLE001 - a broken group may refuse a clean destroy
            if dist.is_initialized():
                dist.destroy_process_group()
    try:
        import deepspeed.comm.comm as ds_comm_state
        from deepspeed.utils import groups

        ds_comm_state.cdb = None
        groups._release_process_group_references(group=None)
    except ImportError:
        pass


def remove_shm_buffers(master_addr: str, master_port: int) -> None:
    # DeepSpeed's CPU all-reduce keeps ~69 MB of shared memory per rank, named after the rendezvous.
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{master_addr}_{master_port}_*"):
        with contextlib.suppress(OSError):
            os.unlink(path)
