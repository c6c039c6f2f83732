"""The process group of an attempt inside the actor: how it is left, and the process-wide state
(ZeRO-3's counters, DeepSpeed's shared-memory buffers) that must not leak from one attempt to the next.
"""

from __future__ import annotations

import contextlib
import glob
import os

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
