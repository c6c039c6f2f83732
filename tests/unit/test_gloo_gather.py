"""compat/torch_dist/gloo_gather.py's piecing, against a fake gather of a chosen world size (real gloo ranks:
tests/integration/test_gloo_gather_pieces.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from elastictrain.compat.torch_dist import gloo_gather


class _Done:
    def wait(self) -> bool:
        return True


def _fake_gather(world: int, sent: list[int]) -> Any:
    """Rank r holds this rank's input plus r."""

    def gather(output_tensor: Any, input_tensor: Any, group: Any = None, async_op: bool = False) -> Any:
        sent.append(input_tensor.numel() * input_tensor.element_size())
        for r in range(world):
            output_tensor.view(world, -1)[r].copy_(input_tensor + r)
        return _Done() if async_op else None

    return gather


@pytest.mark.parametrize("async_op", [True, False])
def test_three_ranks_gather_in_pieces_of_at_most_the_piece_size_into_the_whole_layout(monkeypatch, async_op):
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 3)
    sent: list[int] = []
    gather = gloo_gather.gather_in_pieces(_fake_gather(3, sent), piece_bytes=4000)
    x = torch.arange(2500, dtype=torch.float32)  # 10,000 bytes: pieces of 1000, 1000 and 500 elements
    out = torch.empty(3 * 2500)
    handle = gather(output_tensor=out, input_tensor=x, async_op=async_op)
    if async_op:
        assert not handle.is_completed()
        handle.wait()
        assert handle.is_completed()
    else:
        assert handle is None
    assert sent == [4000, 4000, 2000]
    assert torch.equal(out, torch.cat([x, x + 1, x + 2]))


def test_two_ranks_and_small_gathers_run_whole(monkeypatch):
    sent: list[int] = []
    for world, n in [(2, 2500), (3, 1000)]:
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None, w=world: w)
        gather = gloo_gather.gather_in_pieces(_fake_gather(world, sent), piece_bytes=4000)
        x = torch.ones(n)
        out = torch.empty(world * n)
        gather(output_tensor=out, input_tensor=x)
        assert torch.equal(out, torch.cat([x + r for r in range(world)]))
    assert sent == [10000, 4000]


def test_a_piece_is_a_quarter_of_the_send_buffer_between_1_and_16_mib():
    mib = 1 << 20
    assert gloo_gather.piece_bytes(0) == mib  # buffers tuned by TCP
    assert gloo_gather.piece_bytes(8 * mib) == 2 * mib
    assert gloo_gather.piece_bytes(425_984) == mib  # a stock kernel's fixed buffer: never below 1 MiB
    assert gloo_gather.piece_bytes(512 * mib) == 16 * mib


def test_a_gathers_piece_size_can_be_changed_after_it_is_made(monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 3)
    sent: list[int] = []
    gather = gloo_gather.gather_in_pieces(_fake_gather(3, sent), piece_bytes=4000)
    gather.piece_bytes = 8000
    gather(output_tensor=torch.empty(3 * 2500), input_tensor=torch.ones(2500))
    assert sent == [8000, 2000]


def test_only_gloo_gathers_in_pieces():
    assert gloo_gather.use_gather_in_pieces("nccl") is False
