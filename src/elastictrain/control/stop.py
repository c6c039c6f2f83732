"""SIGTERM (`ray job stop`, a pod being deleted) stops a run as Ctrl-C does.

The handler raises `Stopped` (a KeyboardInterrupt) in the main thread, so the loop's one stop path
runs: stepping ends, the checkpoint in flight is committed if its files are all written or dropped,
STOPPED is recorded, workers are shut down. Later SIGTERMs are ignored so that this cleanup, bounded
well within a pod's 30-second grace period, is not cut short by a second signal.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

log = logging.getLogger("elastictrain.controller")


class Stopped(KeyboardInterrupt):
    """The driver was asked to stop by a signal."""


@contextmanager
def sigterm_stops() -> Iterator[None]:
    """While inside, SIGTERM raises Stopped in the main thread (elsewhere: no change)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired: list[int] = []

    def handler(signum: int, _frame: FrameType | None) -> None:
        if fired:
            log.warning("SIGTERM again: already stopping (committing or dropping the checkpoint in flight)")
            return
        fired.append(signum)
        raise Stopped("stopped by SIGTERM")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
