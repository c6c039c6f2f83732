"""When bad steps call for a rollback: consecutive steps not applied, or a loss spike, and when a rollback
that recurs too soon ends the run instead. Decisions over step numbers and losses only.

A step here is 1-based (the state after it is step `n`); a rollback returns to a state before the first
of its steps and skips their batches.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RollBack:
    """Return to a state at or before `first - 1` and skip the batches of `steps`."""

    steps: tuple[int, ...]
    cause: str  # "bad_steps" (consecutive steps not applied) or "loss_spike"
    detail: str

    @property
    def first(self) -> int:
        return self.steps[0]


@dataclass(frozen=True)
class GiveUp:
    """A rollback due within the window of an earlier one: the run stops."""

    steps: tuple[int, ...]
    earlier: tuple[int, ...]  # the earlier rollback's steps
    cause: str
    detail: str


@dataclass
class BadStepWatch:
    """Feeds on each step's outcome in order; a step seen again (a replay after a restart) replaces what
    was seen of it and of every step after it."""

    max_bad_steps: int  # consecutive steps not applied before a rollback; 0: never
    window: int  # a second rollback whose first step is within this many steps of the last one's: stop
    spike_factor: float = 0.0  # a loss above this times the median of the last `spike_window`: 0 off
    spike_window: int = 20
    streak: list[int] = field(default_factory=list)  # the current run of consecutive steps not applied
    losses: dict[int, float] = field(default_factory=dict)  # applied steps' losses, the newest kept
    rollbacks: list[tuple[int, ...]] = field(default_factory=list)

    def observe(
        self, step: int, *, applied: bool, loss: float, counts: bool = True
    ) -> RollBack | GiveUp | None:
        """After step `step`. `counts`: whether a step not applied counts toward a rollback (not an fp16
        loss-scale overflow with a finite loss, which is the scaler calibrating, nor a step skipped on
        purpose)."""
        self.streak = [s for s in self.streak if s < step]
        for s in [s for s in self.losses if s >= step]:
            del self.losses[s]
        if not applied:
            if not counts:
                return None
            self.streak.append(step)
            if self.max_bad_steps > 0 and len(self.streak) >= self.max_bad_steps:
                steps = tuple(self.streak)
                why = f"{len(steps)} steps in a row were not applied (failure.max_bad_steps)"
                return self._decide(steps, "bad_steps", why)
            return None
        self.streak = []
        spike = self._spike(loss)
        if math.isfinite(loss):
            self.losses[step] = loss
            while len(self.losses) > max(self.spike_window, 1):
                del self.losses[min(self.losses)]
        if spike is not None:
            return self._decide((step,), "loss_spike", spike)
        return None

    def _spike(self, loss: float) -> str | None:
        if self.spike_factor <= 0 or len(self.losses) < self.spike_window or not math.isfinite(loss):
            return None
        median = statistics.median(self.losses.values())
        if loss <= self.spike_factor * median:
            return None
        return (
            f"its loss {loss:.4g} is {loss / median:.2f}x the median {median:.4g} of the last "
            f"{len(self.losses)} steps (failure.loss_spike={self.spike_factor})"
        )

    def _decide(self, steps: tuple[int, ...], cause: str, detail: str) -> RollBack | GiveUp:
        self.streak = []
        for earlier in self.rollbacks:
            if abs(steps[0] - earlier[0]) <= self.window:
                return GiveUp(steps, earlier, cause, detail)
        self.rollbacks.append(steps)
        for s in [s for s in self.losses if s >= steps[0]]:
            del self.losses[s]
        return RollBack(steps, cause, detail)

    def first_bad(self) -> int | None:
        """The first step of the streak in progress (a good checkpoint before it is kept), or None."""
        return self.streak[0] if self.streak else None
