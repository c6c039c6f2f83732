"""What a step costs around its engine: the driver's wall time per step less the slowest rank's time in
forward, backward and update. The rest is data collation, the driver's round trip, gathering the replies,
loss and token accounting, metrics, run-state writes, snapshots and checkpoint pauses: what a system adds
to the same arithmetic, and most of a step for small models, LoRA and short sequences."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class StepCosts:
    """Each completed step's wall time and engine time (seconds), as the driver saw them."""

    walls: list[float] = field(default_factory=list)
    engines: list[float] = field(default_factory=list)

    def add(self, wall_s: float, engine_s: float) -> None:
        if wall_s > 0:  # the first step after a (re)start has no step before it to measure from
            self.walls.append(wall_s)
            self.engines.append(min(engine_s, wall_s))

    def figures(self) -> dict[str, float]:
        """Medians over the steps: wall, engine and the rest (each step's own difference), in seconds."""
        if not self.walls:
            return {}
        rest = [w - e for w, e in zip(self.walls, self.engines, strict=True)]
        return {
            "steps": float(len(self.walls)),
            "median_step_s": statistics.median(self.walls),
            "median_engine_s": statistics.median(self.engines),
            "median_rest_s": statistics.median(rest),
        }

    def describe(self) -> str:
        f = self.figures()
        if not f:
            return ""
        return (
            f"step time (median of {int(f['steps'])}): {f['median_step_s']:.3f}s, of which "
            f"{f['median_engine_s']:.3f}s in the engine (forward, backward, update on the slowest rank) "
            f"and {f['median_rest_s'] * 1000:.1f} ms around it (data, the driver's round trip, metrics, "
            "snapshots, checkpoint pauses)"
        )
