"""Naming a slow rank: one whose own compute (its forward passes, which await no other rank without
ZeRO-3) is more than `factor` times the other ranks' median for `steps` consecutive steps. Every rank of a
synchronous step waits for the slowest in its collectives, so a step's wall time cannot say which rank it
was; a rank's forward time can."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


def ratios(seconds: dict[int, float]) -> dict[int, float]:
    """Each rank's seconds over the median of the other ranks' (1.0 where the others took no time)."""
    out = {}
    for rank, own in seconds.items():
        others = statistics.median(s for r, s in seconds.items() if r != rank)
        out[rank] = own / others if others > 0 else 1.0
    return out


@dataclass
class StragglerWatch:
    factor: float  # 0: off
    steps: int
    slow_for: dict[int, int] = field(default_factory=dict)  # rank -> consecutive slow steps
    named: set[int] = field(default_factory=set)  # named and not yet back to the others' pace

    def observe(self, seconds: dict[int, float]) -> list[tuple[int, float]]:
        """One step's forward seconds by rank: the ranks named now, each with its ratio to the others."""
        if self.factor <= 0 or len(seconds) < 2:
            return []
        named_now = []
        for rank, ratio in ratios(seconds).items():
            if ratio <= self.factor:
                self.slow_for[rank] = 0
                self.named.discard(rank)
                continue
            self.slow_for[rank] = self.slow_for.get(rank, 0) + 1
            if self.slow_for[rank] >= self.steps and rank not in self.named:
                self.named.add(rank)
                named_now.append((rank, ratio))
        return named_now

    def forget(self) -> None:
        """A new attempt: ranks are renumbered, what was counted no longer applies."""
        self.slow_for.clear()
        self.named.clear()
