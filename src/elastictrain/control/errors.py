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


class RollBackDue(Exception):
    """Bad steps call for a return to a state before them (control/bad_steps.py); the loop rolls back."""

    def __init__(self, steps: tuple[int, ...], cause: str, message: str) -> None:
        super().__init__(message)
        self.steps = steps
        self.cause = cause

    @property
    def before(self) -> int:
        """The newest state the rollback may return to: the one before its first step."""
        return self.steps[0] - 1
