"""How an attempt or the whole run ends early: raised by the parts, caught by the loop."""

from __future__ import annotations

from elastictrain.core.policy import Failure


class AttemptFailed(Exception):
    """The attempt cannot go on; the loop decides what follows from `failure`."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure


class RunFailed(Exception):
    """The run cannot go on (budget spent, no capacity, a wrong checkpoint): recorded as FAILED."""
