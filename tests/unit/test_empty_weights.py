"""Empty structures (meta parameters) are built in one thread without touching models other threads build."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from elastictrain.model.empty import empty_weights


class WithBuffer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.arange(4.0))


def test_inside_parameters_are_on_meta_and_buffers_real_and_outside_nothing_changes():
    with empty_weights():
        empty = WithBuffer()
    assert empty.proj.weight.device.type == "meta" and empty.proj.weight.requires_grad
    assert torch.equal(empty.scale, torch.arange(4.0))
    assert WithBuffer().proj.weight.device.type == "cpu"


def _crossed(enter: Callable[[], object]) -> None:
    """Two threads enter an empty-weights context, the first leaves before the second, and meanwhile a
    third thread builds a real model; raises if that model's parameters were not real."""
    a_in, b_in, a_out, built = (threading.Event() for _ in range(4))
    failures: list[str] = []

    def first() -> None:
        with enter():  # type: ignore[attr-defined]
            a_in.set()
            b_in.wait(10)
            built.wait(10)
        a_out.set()

    def second() -> None:
        a_in.wait(10)
        with enter():  # type: ignore[attr-defined]
            b_in.set()
            a_out.wait(10)

    def builder() -> None:
        b_in.wait(10)
        if WithBuffer().proj.weight.device.type != "cpu":
            failures.append("a model built in another thread got meta parameters")
        built.set()

    threads = [threading.Thread(target=f) for f in (first, second, builder)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    if WithBuffer().proj.weight.device.type != "cpu":
        failures.append("after both left, models still get meta parameters")
    assert not failures, failures


def test_overlapping_threads_leave_real_models_real_during_and_after():
    _crossed(empty_weights)


def test_accelerates_own_context_fails_the_same_check_which_is_why_it_is_not_used():
    from accelerate import init_empty_weights

    original = torch.nn.Module.register_parameter
    try:
        _crossed(init_empty_weights)
    except AssertionError as e:
        assert "another thread got meta parameters" in str(e)
    else:
        raise AssertionError("accelerate's init_empty_weights passed: the check above cannot fail")
    finally:
        torch.nn.Module.register_parameter = original  # type: ignore[method-assign]
