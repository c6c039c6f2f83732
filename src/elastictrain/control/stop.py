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
from dataclasses import dataclass
from types import FrameType

log = logging.getLogger("elastictrain.controller")


STOPPED_BY_SIGTERM = "stopped by SIGTERM"


class Stopped(KeyboardInterrupt):
    """The driver was asked to stop by a signal."""


@dataclass
class Signals:
    """What `sigterm_stops` saw. The `Stopped` it raises can reach the loop as another
    KeyboardInterrupt (code the signal interrupted may catch it and raise its own: a suite run
    recorded "interrupted" for a SIGTERMed driver), so the loop asks this, not the exception."""

    sigterm: bool = False


@contextmanager
def sigterm_stops() -> Iterator[Signals]:
    """While inside, SIGTERM raises Stopped in the main thread (elsewhere: no change)."""
    seen = Signals()
    if threading.current_thread() is not threading.main_thread():
        yield seen
        return

    def handler(signum: int, _frame: FrameType | None) -> None:
        if seen.sigterm:
            log.warning("SIGTERM again: already stopping (committing or dropping the checkpoint in flight)")
            return
        seen.sigterm = True
        raise Stopped(STOPPED_BY_SIGTERM)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGTERM, previous)
