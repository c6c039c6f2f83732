"""A rank that leaves a broken attempt releases the peers blocked on it in a gloo collective at once.

Real gloo process groups in 3 processes: rank 0 leaves the collective while something still holds its
process group (as a ZeRO-3 parameter or a traceback does in a worker), so destroying the group does not
close its connections; ranks 1 and 2 are blocked in a ring all-gather waiting on it.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import time
from typing import Any

import pytest
from helpers import three_ranks

pytestmark = pytest.mark.integration

TIMEOUT_S = 10  # the collective timeout: a peer not released raises "Timed out" after it
# The control's: it only has to show gloo's own behaviour (a timeout, not a closed connection), so it
# waits less. Set after the rendezvous, which keeps TIMEOUT_S for ranks that start late on a busy machine.
CONTROL_TIMEOUT_S = 2


def _rank(rank: int, port: int, release: bool, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from elastictrain.compat.torch_dist.collective_sockets import CollectiveSockets
    from elastictrain.worker.dist import destroy_process_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sockets = CollectiveSockets()
    sockets.start()
    dist.init_process_group("gloo", rank=rank, world_size=3, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    sockets.stop()
    dist.all_reduce(torch.ones(1 << 16))
    if not release:
        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(datetime.timedelta(seconds=CONTROL_TIMEOUT_S))
    if rank == 0:
        held = dist.group.WORLD  # noqa: F841 - the leak that keeps the group's connections open
        if release:
            destroy_process_group(False, sockets)
        else:
            dist.destroy_process_group()
        out.put((0, "left"))
        time.sleep(TIMEOUT_S + 10)
        return
    try:
        dist.all_gather_into_tensor(torch.empty(3 << 20), torch.ones(1 << 20))
        out.put((rank, "returned"))
    except Exception as e:  # noqa: BLE001 - the error is the result
        out.put((rank, str(e)))


def _run(release: bool) -> dict[int, str]:
    return three_ranks(mp.get_context("spawn"), _rank, release)


@pytest.mark.timeout(180)
def test_a_rank_leaving_half_closes_its_connections_so_blocked_peers_fail_at_once():
    results = _run(release=True)
    assert results[0] == "left"
    for rank in (1, 2):
        assert "Connection closed by peer" in results[rank], results[rank]


@pytest.mark.timeout(180)
def test_without_it_the_blocked_peers_wait_for_the_collective_timeout():
    results = _run(release=False)
    for rank in (1, 2):
        assert "Timed out" in results[rank], results[rank]
