"""Faults a test or chaos run injects into a worker: a crash, an error or a hang at a step, a slow disk."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING


class WorkerFault(RuntimeError):
    """Raised by an injected fault (chaos testing)."""


class FaultHooks:
    """Mixed into the worker actor: the hooks are actor methods; `_maybe_fault` runs at each step."""

    worker_id: str
    _faults: dict[int, str]
    _write_delay_s: float

    if TYPE_CHECKING:  # the worker's own

        def _set_mark(self, phase: str, step: int) -> None: ...

    def inject_fault(self, kind: str, at_step: int) -> None:
        """Chaos hook: at `at_step`, "crash" (process exits), "raise" (step raises) or "hang" (stops)."""
        if kind not in ("crash", "raise", "hang"):
            raise ValueError(f"fault kind: got {kind!r}; expected crash, raise or hang")
        self._faults[at_step] = kind

    def inject_write_delay(self, seconds: float) -> None:
        """Make every later checkpoint write start `seconds` late, as on a slow disk (tests, chaos)."""
        self._write_delay_s = float(seconds)

    def _maybe_fault(self, step: int) -> None:
        kind = self._faults.pop(step, None)
        if kind == "crash":
            os._exit(17)
        if kind == "raise":
            raise WorkerFault(f"injected fault in worker {self.worker_id} at step {step}")
        if kind == "hang":
            self._set_mark("hung", step)
            while True:  # stops stepping without dying, holding no lock the control thread needs
                time.sleep(3600)
