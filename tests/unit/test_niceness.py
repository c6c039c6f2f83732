"""A thread's own priority: background work yields the cores without slowing the threads that train."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from elastictrain.host.niceness import LOWEST, run_at_lowest_priority


def _own_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")
def test_work_runs_at_the_lowest_priority_and_the_caller_keeps_its_own():
    before = _own_nice()
    assert run_at_lowest_priority(_own_nice, "test") == max(LOWEST, before)
    assert _own_nice() == before


def test_an_error_in_the_work_is_raised_in_the_caller():
    def fail() -> None:
        raise ValueError("a bad warm-up")

    with pytest.raises(ValueError, match="a bad warm-up"):
        run_at_lowest_priority(fail, "test")
