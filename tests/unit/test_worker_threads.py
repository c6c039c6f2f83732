"""A worker's torch threads (host/threads.py): the cores it was given, or the machine's when alone on it."""

from __future__ import annotations

from elastictrain.host.threads import use_threads, worker_threads


def test_the_only_rank_on_a_machine_uses_every_core_as_torch_would():
    assert worker_threads(1.0, ranks_on_node=1, node_cpus=16) == 16


def test_ranks_sharing_a_machine_use_the_cores_ray_gave_each():
    assert worker_threads(4.0, ranks_on_node=2, node_cpus=16) == 4
    assert worker_threads(0.5, ranks_on_node=3, node_cpus=2) == 1


def test_a_reservation_larger_than_the_visible_cores_is_honoured():
    assert worker_threads(8.0, ranks_on_node=1, node_cpus=4) == 8


def test_use_threads_sets_torchs_intra_op_threads():
    import torch

    before = torch.get_num_threads()
    try:
        assert use_threads(1.0, ranks_on_node=2) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
