"""ZeRO-3's all-gathers over gloo with three or more ranks, cut into sends a socket takes whole.

gloo's ring all-gather has each rank send to its right neighbour and receive from its left. A send
larger than what the connection's kernel buffers take at once stays half-written in gloo's transmit
queue until its event loop finishes it. If the right neighbour dies then, gloo closes the connection
but never fails that send (its TCP pair fails bound buffers and not-yet-started operations, not an
unbound send already queued), and the rank's receive from its live left neighbour has completed: the
collective waits for the process group's timeout (minutes) instead of raising, and the controller must
replace a rank that could have stayed. With two ranks the left and right neighbour are the same peer,
whose failed receive fails the collective. Measured with three gloo processes gathering 16.4 MB (a
30M model's embedding slice) in a loop, one killed at a random moment: the survivor on its left stayed
stuck in 23 of 75 kills with whole gathers (run tests/integration/test_gloo_gather_pieces.py as a
script to see it).

So with three or more ranks on gloo, a gather of more than a piece a rank runs as pieces (gloo sends
each in two halves), started at once, copied into place on `wait()`. The values are the same bit for
bit; the cost is one copy of the gathered bytes and a collective per piece, which is why a piece is as
large as is safe: 1 MiB pieces made 3-rank 30M steps on 2 cores 25% slower. Where each connection got
the largest send buffer (compat/torch_dist/collective_sockets.py: 8 MiB here) a piece is a quarter of it
(2 MiB): the two halves of a piece and of a second one gloo runs beside it fill at most half the buffer.
With half-buffer pieces (4 MiB) the kill test left none stuck in 45 kills on a quiet machine but one in 8
inside a full test-suite run. Where TCP tunes the buffers itself, 1 MiB. Every rank must cut a gather
into the same pieces, so the ranks agree on the smallest size. This makes a stuck survivor rare, not
impossible (only gloo can fail those sends); the controller still replaces one that cannot leave. NCCL
(GPUs) is untouched: its communicators are aborted on a failure.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from elastictrain.compat.registry import has_attributes, patch, shape_mismatch

PIECE_BYTES = 1 << 20  # with TCP's own send-buffer tuning
MAX_PIECE_BYTES = 16 << 20

AllGather = Callable[..., Any]  # torch.distributed.all_gather_into_tensor's signature


class _PiecesWork:
    """The handle of a gather run as pieces: `wait()` waits for each and copies it into place."""

    def __init__(self, output: Any, pieces: list[tuple[int, int, Any, Any]]) -> None:
        self._output = output  # the caller's output, viewed as (world, per-rank elements)
        self._pieces = pieces  # (start, length, gathered buffer, work) for each piece
        self._done = False

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            for start, length, gathered, work in self._pieces:
                work.wait()
                self._output[:, start : start + length].copy_(gathered.view(self._output.shape[0], length))
            self._pieces = []
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done


def piece_bytes(send_buffer: int) -> int:
    """A piece for connections whose smallest send buffer is `send_buffer` bytes (0: tuned by TCP):
    a quarter of it, so two pieces' sends in flight at once fill at most half."""
    if send_buffer <= 0:
        return PIECE_BYTES
    return max(PIECE_BYTES, min(send_buffer // 4, MAX_PIECE_BYTES))


def agreed_piece_bytes(size: int) -> int:
    """The smallest of every rank's piece size (a collective): ranks whose nodes allow different send
    buffers would otherwise run different numbers of collectives for one gather."""
    import torch
    import torch.distributed as dist

    smallest = torch.tensor([size], dtype=torch.int64)
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
    return int(smallest.item())


def gather_in_pieces(all_gather: AllGather, piece_bytes: int = PIECE_BYTES) -> AllGather:
    """`all_gather` (all_gather_into_tensor's signature) that gathers more than `piece_bytes` a rank in
    pieces when its group has three or more ranks (the size can be changed later: `.piece_bytes`)."""
    import torch.distributed as dist

    def gather(output_tensor: Any, input_tensor: Any, group: Any = None, async_op: bool = False) -> Any:
        world = dist.get_world_size(group)
        per_piece = max(1, gather.piece_bytes // input_tensor.element_size())  # type: ignore[attr-defined]
        n = input_tensor.numel()
        if world < 3 or n <= per_piece or not output_tensor.is_contiguous():
            whole = {"output_tensor": output_tensor, "input_tensor": input_tensor}
            return all_gather(**whole, group=group, async_op=async_op)
        flat = input_tensor.reshape(-1)
        pieces = []
        for start in range(0, n, per_piece):
            part = flat[start : start + per_piece]
            gathered = output_tensor.new_empty(world * part.numel())
            work = all_gather(output_tensor=gathered, input_tensor=part, group=group, async_op=True)
            pieces.append((start, part.numel(), gathered, work))
        handle = _PiecesWork(output_tensor.view(world, n), pieces)
        if async_op:
            return handle
        handle.wait()
        return None

    gather.piece_bytes = piece_bytes  # type: ignore[attr-defined]
    return gather


def _check() -> str | None:
    import deepspeed.comm.comm as ds_comm
    from deepspeed.comm.torch import TorchBackend

    return has_attributes(ds_comm, "cdb") or has_attributes(
        TorchBackend, "all_gather_into_tensor", "get_all_gather_function"
    )


@patch(
    "gloo_gather_in_pieces",
    package="deepspeed",
    kind="performance",
    check=_check,
    otherwise=lambda backend, size=PIECE_BYTES: False,
    gains=(
        "escaping a stuck collective (3+ gloo ranks): a survivor stuck until the collective timeout in 23 of"
        " 75 kills with whole gathers, 0 of 25 in pieces; kept instead of replaced"
    ),
)
def use_gather_in_pieces(backend: str, size: int = PIECE_BYTES) -> bool:
    """Make DeepSpeed's communication backend of this attempt gather in pieces of `size` bytes on gloo
    (again: change the size); whether it does.

    What: `deepspeed.comm.comm.cdb.all_gather_function` (the function its `all_gather_into_tensor`, which
    ZeRO-3's parameter gathers call, runs) is replaced by `gather_in_pieces` around it.
    Why: with three or more gloo ranks a survivor of a rank killed in the middle of a large gather stayed
    stuck until the collective timeout (the module's docstring), and was replaced when it could have
    stayed: recovery time, not values (the gathered bytes are the same).
    Retired by: gloo failing a queued unbound send when its connection closes (its TCP pair); no
    upstream issue found.
    """
    if backend != "gloo":
        return False
    import deepspeed.comm.comm as ds_comm

    cdb = ds_comm.cdb
    current = getattr(cdb, "all_gather_function", None)
    if current is None:
        shape_mismatch("gloo_gather_in_pieces", f"{type(cdb).__name__} has no all_gather_function")
        return False
    if hasattr(current, "piece_bytes"):  # a backend is made per attempt; wrap it once
        current.piece_bytes = size
    else:
        cdb.all_gather_function = gather_in_pieces(current, size)
    return True
