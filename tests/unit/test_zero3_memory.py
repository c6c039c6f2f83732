"""ZeRO-3's gradients handed to the optimizer as a view of their buffer, not a flattened copy."""

from __future__ import annotations

import torch

from elastictrain.compat.deepspeed.zero3_memory import _prepare_grad_view, contiguous_run


def test_back_to_back_views_of_one_buffer_become_one_view_without_a_copy():
    buffer = torch.arange(10, dtype=torch.float32)
    run = contiguous_run([buffer.narrow(0, 2, 3), buffer.narrow(0, 5, 4)], torch.float32, 7)
    assert run is not None
    assert run.data_ptr() == buffer.narrow(0, 2, 1).data_ptr()
    assert run.tolist() == [2, 3, 4, 5, 6, 7, 8]


def test_a_gap_another_order_dtype_or_size_gets_no_view():
    buffer = torch.zeros(10)
    a, b, c = buffer.narrow(0, 0, 3), buffer.narrow(0, 4, 3), buffer.narrow(0, 3, 1)
    assert contiguous_run([a, b], torch.float32, 6) is None  # element 3 lies between them
    assert contiguous_run([a, buffer.narrow(0, 3, 3)], torch.float32, 5) is None  # not the size asked
    assert contiguous_run([c, a], torch.float32, 4) is None  # out of order
    assert contiguous_run([a], torch.bfloat16, 3) is None
    assert contiguous_run([a, torch.zeros(3)], torch.float32, 6) is None  # another storage
    assert contiguous_run([], torch.float32, 0) is None


class _Stage3Like:
    """What `_prepare_grad_view` reads of DeepSpeed's ZeRO-3 optimizer; its own method notes the fallback."""

    def __init__(self, grads: list[torch.Tensor], numel: int) -> None:
        self.averaged_gradients = [grads]
        self.fp32_partitioned_groups_flat = [torch.zeros(numel)]
        self.fell_back = False

    def _prepare_fp32_grad_for_sub_group(self, sub_group_id: int) -> None:
        self.fell_back = True


def test_the_optimizer_gets_the_buffer_itself_and_scaling_it_scales_the_buffer():
    buffer = torch.ones(6)
    opt = _Stage3Like([buffer.narrow(0, 0, 2), buffer.narrow(0, 2, 4)], 6)
    _prepare_grad_view(opt, 0)
    grad = opt.fp32_partitioned_groups_flat[0].grad
    assert not opt.fell_back and opt.averaged_gradients == [None]
    grad.mul_(0.5)  # as DeepSpeed's unscale-and-clip does, in place
    assert buffer.tolist() == [0.5] * 6


def test_gradients_that_are_not_one_run_go_through_deepspeeds_own_copy():
    opt = _Stage3Like([torch.ones(2), torch.ones(4)], 6)
    _prepare_grad_view(opt, 0)
    assert opt.fell_back
