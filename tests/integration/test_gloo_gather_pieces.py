"""With three or more gloo ranks, ZeRO-3's all-gathers run in pieces a socket takes whole, so a
rank killed in the middle of one leaves none of its peers stuck (compat/torch_dist/gloo_gather.py
says why they were).

Real gloo process groups in 3 processes (forked from a server that imported torch once, so a trial
costs no interpreter start). Run as a script to compare whole gathers with pieces over more trials:
`PYTHONPATH=tests .venv/bin/python tests/integration/test_gloo_gather_pieces.py 10`.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import three_ranks
from readme_blocks import free_ports

pytestmark = pytest.mark.integration

TIMEOUT_S = 60  # the collective timeout: a stuck survivor is released only after it
STUCK_AFTER_S = 10  # a survivor still gathering this long after the kill is stuck (it leaves in ~0.1 s)
ELEMENTS = 4_100_000  # 16.4 MB of fp32 a rank: a 30M Llama's embedding slice at 3 ranks


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


def _init(rank: int, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=3, timeout=datetime.timedelta(seconds=TIMEOUT_S))


def _gather_until_killed(rank: int, port: int, pieces: bool, abort: str, out: Any) -> None:
    """Gather in a loop; leave (half-closing this rank's connections, as a worker does) on `abort`."""
    import torch
    import torch.distributed as dist

    from elastictrain.compat.torch_dist.collective_sockets import CollectiveSockets
    from elastictrain.compat.torch_dist.gloo_gather import agreed_piece_bytes, gather_in_pieces, piece_bytes

    sockets = CollectiveSockets()
    sockets.start()
    _init(rank, port)
    sockets.stop()
    if pieces:  # as a worker does
        size = agreed_piece_bytes(piece_bytes(sockets.widen_send_buffers()))
        gather = gather_in_pieces(dist.all_gather_into_tensor, size)
    else:
        gather = dist.all_gather_into_tensor
    x, gathered = torch.full((ELEMENTS,), float(rank)), torch.empty(3 * ELEMENTS)
    gather(output_tensor=gathered, input_tensor=x)
    out.put((rank, "ready"))

    def leave_on_abort() -> None:
        while not os.path.exists(abort):
            time.sleep(0.01)
        sockets.half_close()

    threading.Thread(target=leave_on_abort, daemon=True).start()
    try:
        while True:
            gather(output_tensor=gathered, input_tensor=x)
    except Exception as e:  # noqa: BLE001 - leaving is the result
        out.put((rank, f"left {time.time():.3f}: {str(e)[:80]}"))


def kill_trials(trials: int, pieces: bool, tmp: Path) -> list[dict[int, str]]:
    """Each trial: 3 ranks gather, rank 2 is killed at a random moment, then the others are told to
    leave; what each survivor did within STUCK_AFTER_S ("stuck" if it still gathered)."""
    ctx = _context()
    outcomes = []
    for trial in range(trials):
        out = ctx.Queue()
        abort = str(tmp / f"abort-{pieces}-{trial}")  # a file: the survivors leave once it exists
        (port,) = free_ports(1)
        args = [(r, port, pieces, abort, out) for r in range(3)]
        procs = [ctx.Process(target=_gather_until_killed, args=a) for a in args]
        for p in procs:
            p.start()
        try:
            assert sorted(out.get(timeout=120) for _ in range(3)) == [(r, "ready") for r in range(3)]
            time.sleep(random.uniform(0.2, 0.8))
            os.kill(procs[2].pid, signal.SIGKILL)
            time.sleep(0.2)  # the controller notices a death and aborts the survivors
            Path(abort).touch()
            left: dict[int, str] = {}
            deadline = time.time() + STUCK_AFTER_S
            while len(left) < 2 and time.time() < deadline:
                try:
                    rank, what = out.get(timeout=max(0.01, deadline - time.time()))
                    left[rank] = what
                except Exception:  # noqa: BLE001 - queue.Empty: the deadline passed
                    break
            outcomes.append({r: left.get(r, "stuck") for r in (0, 1)})
        finally:
            for p in procs:
                p.kill()
                p.join(timeout=10)
    return outcomes


@pytest.mark.timeout(300)
def test_a_rank_killed_mid_gather_leaves_its_survivors_stuck_rarely(tmp_path):
    """Rare, not never: only gloo can fail a half-written send. Whole gathers left a survivor stuck in
    23 of 75 kills, so at most 1 in 12 passes by chance with them with probability ~0.07."""
    outcomes = kill_trials(12, pieces=True, tmp=tmp_path)
    stuck = [o for o in outcomes if any(not what.startswith("left") for what in o.values())]
    assert len(stuck) <= 1, stuck


def _compare_gathers(rank: int, port: int, out: Any) -> None:
    """DeepSpeed's gather of this attempt's backend, in pieces, against gloo's whole gather."""
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), WORLD_SIZE="3", LOCAL_RANK="0")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed
    import torch
    import torch.distributed as dist

    from elastictrain.compat.torch_dist.gloo_gather import (
        PIECE_BYTES,
        agreed_piece_bytes,
        use_gather_in_pieces,
    )

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    import deepspeed.comm as ds_comm

    sent: list[int] = []  # bytes a rank put into each gather gloo ran
    inner = ds_comm.comm.cdb.all_gather_function

    def recorded(**kw: Any) -> Any:
        sent.append(kw["input_tensor"].numel() * kw["input_tensor"].element_size())
        return inner(**kw)

    ds_comm.comm.cdb.all_gather_function = recorded
    used = use_gather_in_pieces("gloo") and use_gather_in_pieces("gloo")  # the second must not wrap again
    results = {"used": used, "agreed": agreed_piece_bytes((rank + 1) << 20)}
    g = torch.Generator().manual_seed(rank)
    for n, dtype in [(3_000_007, torch.float32), (700_001, torch.bfloat16), (1000, torch.float32)]:
        x = torch.randn(n, generator=g).to(dtype)
        whole = torch.empty(3 * n, dtype=dtype)
        dist.all_gather_into_tensor(whole, x)
        sent.clear()
        pieces = torch.empty(3 * n, dtype=dtype)
        ds_comm.all_gather_into_tensor(pieces, x, async_op=True).wait()
        waited = torch.empty(3 * n, dtype=dtype)
        ds_comm.allgather_fn(waited, x)  # synchronous: gathered on return
        results[f"{n}"] = (
            torch.equal(whole, pieces) and torch.equal(whole, waited),
            len(sent),
            max(sent) <= PIECE_BYTES,
            torch.equal(whole.view(3, n)[rank], x),
        )
    out.put((rank, results))


@pytest.mark.timeout(300)
def test_deepspeeds_gathers_run_in_pieces_with_the_same_values_on_three_gloo_ranks():
    results = three_ranks(_context(), _compare_gathers, timeout_s=240)
    for rank in range(3):
        r = results[rank]
        assert r["used"], r
        assert r["agreed"] == 1 << 20, r  # every rank takes the smallest rank's size
        # 12 MB of fp32: 12 pieces of at most 1 MiB, twice (async, then synchronous).
        assert r["3000007"] == (True, 2 * 12, True, True), r
        assert r["700001"] == (True, 2 * 2, True, True), r  # 1.4 MB of bf16: 2 pieces
        assert r["1000"] == (True, 2, True, True), r  # 4 KB: gathered whole


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    for pieces in (False, True):
        outcomes = kill_trials(n, pieces, Path(tempfile.mkdtemp()))
        stuck = sum(any(v == "stuck" for v in o.values()) for o in outcomes)
        kind = "pieces" if pieces else "whole"
        print(f"{kind} gathers: a survivor stuck in {stuck} of {n} kills", flush=True)
