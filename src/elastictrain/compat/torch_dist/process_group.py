"""torch.distributed's private abort of NCCL communicators, used when a rank leaves a broken attempt."""

from __future__ import annotations

from elastictrain.compat.registry import has_parameters, patch


def _check() -> str | None:
    from torch.distributed import distributed_c10d

    return has_parameters(distributed_c10d._abort_process_group, "group")


def _not_aborted() -> bool:
    return False


@patch(
    "nccl_process_group_aborted",
    package="torch",
    tested=">=2.4,<=2.14.1",
    kind="performance",
    check=_check,
    otherwise=_not_aborted,
    gains=(
        "escaping a stuck collective (GPU): a rank waiting on a dead peer's NCCL kernel leaves the attempt "
        "and is kept instead of waiting out the timeout (minutes) and being replaced"
    ),
)
def abort_process_group() -> bool:
    """Abort every NCCL communicator of this process (`torch.distributed.distributed_c10d.
    _abort_process_group()`); whether it was called.

    What: calls torch's private abort of the default group and its subgroups.
    Why: a CUDA kernel waiting on a dead peer never returns; aborting lets this rank's training thread
    raise now, leave the attempt and be kept, instead of waiting for the collective timeout (minutes)
    and being replaced. Without it the controller still replaces the rank: recovery time, not values.
    Retired by: a public `torch.distributed` abort (PyTorch's `ProcessGroup.abort()` for every group,
    still private as `_abort_process_group` in torch 2.13).
    """
    from torch.distributed import distributed_c10d

    distributed_c10d._abort_process_group()
    return True
