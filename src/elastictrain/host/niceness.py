"""A thread's own CPU priority: Linux keeps a nice value per thread, so one thread can yield the cores
to the others of its process (and its subprocesses inherit that) without changing theirs."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
LOWEST = 19


def lower_this_threads_priority(nice: int) -> None:
    """Raise the calling thread's nice value to `nice` (where the platform allows; a thread cannot
    lower it again without privileges, so only threads that end soon or do background work call it)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


def run_at_lowest_priority(work: Callable[[], T], name: str) -> T:
    """`work()` in a thread of its own at nice 19, waited for: its result, or its exception raised here."""

    def run() -> T:
        lower_this_threads_priority(LOWEST)
        return work()

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix=name) as pool:
        return pool.submit(run).result()
