"""The process group of an attempt inside the actor: how it is left, and the process-wide state
(DeepSpeed's engines and groups, its shared-memory buffers) that must not leak from one attempt to the
next. What this changes inside DeepSpeed and torch.distributed lives in compat/.
"""

from __future__ import annotations

import contextlib
import glob
import os
from typing import Any

from elastictrain.compat.deepspeed.process_state import forget_process_groups, release_engine_references
from elastictrain.compat.torch_dist.collective_sockets import CollectiveSockets
from elastictrain.compat.torch_dist.process_group import abort_process_group
from elastictrain.worker.attempt import AttemptSpec


def release_engine(engine: Any) -> None:
    """Let a dropped engine be freed, not kept by DeepSpeed beside the next one: `destroy()` is DeepSpeed's
    own release (optimizer hooks, buffers); ZeRO-3's process-wide references to it are emptied by
    `compat.deepspeed.process_state.release_engine_references`."""
    if engine is not None and hasattr(engine, "destroy"):
        with contextlib.suppress(Exception):  # leaving an attempt must not fail on a half-built engine
            engine.destroy()
    release_engine_references()


def zero_stage(spec: AttemptSpec) -> int:
    return int(spec.ds_config.get("zero_optimization", {}).get("stage", 0))


def abort_collectives(use_gpu: bool, sockets: CollectiveSockets) -> int:
    """Release every collective this rank takes part in, and the peers waiting on it in one.

    NCCL's communicators are aborted (a kernel waiting on a dead peer never returns otherwise); gloo's
    connections are half-closed (compat/torch_dist/collective_sockets.py), so that a collective
    blocked on this rank raises on every peer, and this rank's own raises once they do the same.
    Returns the number of connections closed.
    """
    import torch.distributed as dist

    if use_gpu and dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):  # best effort; destroy still runs
            abort_process_group()
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
    forget_process_groups()  # the next attempt's engine must not find a group of this world


def remove_shm_buffers(master_addr: str, master_port: int) -> None:
    # DeepSpeed's CPU all-reduce keeps ~69 MB of shared memory per rank, named after the rendezvous.
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{master_addr}_{master_port}_*"):
        with contextlib.suppress(OSError):
            os.unlink(path)
