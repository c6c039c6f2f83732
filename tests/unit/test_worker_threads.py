"""A worker's torch threads (host/threads.py): the cores Ray gave it."""

from __future__ import annotations

from elastictrain.host.threads import use_threads, worker_threads


def test_a_worker_uses_the_cores_it_reserved_at_least_one():
    assert worker_threads(4.0) == 4
    assert worker_threads(0.5) == 1


def test_use_threads_sets_torchs_intra_op_threads():
    import torch

    before = torch.get_num_threads()
    try:
        assert use_threads(1.0) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
