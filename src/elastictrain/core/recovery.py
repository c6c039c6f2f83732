"""What a recovery cost, from the failure's detection (or a grow's decision) to the first step after it.

One value per recovery: the loop makes it when it decides, adds the steps each set-up redoes, and
consumes it with the first step done after it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Recovery:
    detected_at: float  # the failure's detection, or the grow's decision
    stalled_since: float | None = None  # a grow: when the last step before it was done
    lost_steps: int = 0  # steps since the state loaded, added up over set-ups done again
    source: str = "disk"  # where the last set-up loaded the state: "memory" or "disk"

    def set_up(self, redone: int, source: str) -> Recovery:
        return replace(self, lost_steps=self.lost_steps + redone, source=source)

    def detected(self, at: float) -> Recovery:
        """A failure before the first step after this recovery: timed from its detection, keeping the
        steps already lost (and a grow's stall, which began before)."""
        return replace(self, detected_at=at)

    def figures(self, now: float, compute_s: float) -> dict[str, float]:
        """The metrics of the first step after it; `compute_s`: that step's own compute (slowest rank)."""
        since = self.stalled_since if self.stalled_since is not None else self.detected_at
        return {
            "recovery_seconds": now - self.detected_at,
            "steps_lost": float(self.lost_steps),
            "recovered_from_memory": float(self.source == "memory"),
            # The time no rank trained, from the last step done (a grow) or the detection (a failure).
            "stall_seconds": max(0.0, now - since - compute_s),
        }

    def describe(self, figures: dict[str, float]) -> str:
        return (
            f"first step after the restart done {figures['recovery_seconds']:.2f}s after detection; "
            f"{self.lost_steps} step(s) lost; state from {self.source}; training stopped for "
            f"{figures['stall_seconds']:.2f}s"
        )
