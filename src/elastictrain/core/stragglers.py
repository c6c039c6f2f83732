"""Naming a slow rank: one whose own compute (its forward passes, which await no other rank without
ZeRO-3) is more than `factor` times the other ranks' median for `steps` consecutive steps. Every rank of a
synchronous step waits for the slowest in its collectives, so a step's wall time cannot say which rank it
was; a rank's forward time can."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


def ratios(seconds: dict[int, float], stages: int = 1) -> dict[int, float]:
    """Each rank's seconds over the median of the other ranks' (1.0 where the others took no time). With
    pipeline `stages`, over those of the ranks holding the same stage in the other replicas (ranks d*P+s
    hold stage s: stages differ in their layers), 1.0 where no other replica's rank holds it."""
    out = {}
    for rank, own in seconds.items():
        peers = [s for r, s in seconds.items() if r != rank and r % stages == rank % stages]
        others = statistics.median(peers) if peers else 0.0
        out[rank] = own / others if others > 0 else 1.0
    return out


@dataclass
class StragglerWatch:
    factor: float  # 0: off
    steps: int
    slow_for: dict[int, int] = field(default_factory=dict)  # rank -> consecutive slow steps
    named: set[int] = field(default_factory=set)  # named and not yet back to the others' pace

    def observe(self, seconds: dict[int, float], stages: int = 1) -> list[tuple[int, float]]:
        """One step's forward seconds by rank: the ranks named now, each with its ratio to the others (of
        its pipeline stage, with `stages`)."""
        return self.observe_ratios(ratios(seconds, stages))

    def observe_ratios(self, by_rank: dict[int, float]) -> list[tuple[int, float]]:
        """`observe` of ratios computed already (`ratios`)."""
        if self.factor <= 0 or len(by_rank) < 2:
            return []
        named_now = []
        for rank, ratio in by_rank.items():
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


@dataclass(frozen=True)
class Remedy:
    action: str  # "replace" (a warm spare takes its place), "drop" (the run goes on without it), "keep"
    why: str


def straggler_remedy(
    *, world: int, min_workers: int, spare_ready: bool, now_s: float, even_s: float | None, ratio: float
) -> Remedy:
    """What to do with a named straggler (failure.replace_stragglers).

    A warm spare replaces it at once. Without one, the world goes on without it only above min_workers and
    when the smaller world is faster: each of the others then takes world/(world-1) of the samples, at the
    pace the steps had before it slowed (`even_s`, measured; else `now_s / ratio`, the others' pace)
    against `now_s`, the steps' time with it. Either way a replacement is asked for off its node.
    """
    if spare_ready:
        return Remedy("replace", "a warm spare is ready")
    base = even_s if even_s is not None else now_s / max(ratio, 1.0)
    smaller = base * world / (world - 1) if world > 1 else float("inf")
    if world <= min_workers:
        return Remedy("keep", f"no warm spare, and {world} is scaling.min_workers")
    if smaller >= now_s:
        slower = f"{world - 1} ranks would take about {smaller:.3g}s a step against {now_s:.3g}s now"
        return Remedy("keep", f"no warm spare, and {slower}")
    return Remedy(
        "drop", f"{world - 1} ranks take about {smaller:.3g}s a step against {now_s:.3g}s now with it"
    )
