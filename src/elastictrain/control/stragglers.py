"""A rank slower than the others, named with its worker and node: an event, a terminal line, run.json's
`stragglers` (shown by `elastictrain status`) and the `straggler_ratio` metric (the slowest rank's forward
time over the others' median, each step). With failure.replace_stragglers, a warm spare replaces it, or
the run drops it where the smaller world is faster (core/stragglers.straggler_remedy): it is stopped as a
lost worker is (the others go on from memory) and its node is avoided for new workers for
failure.straggler_avoid_s. The rules are pure (core/stragglers.py)."""

from __future__ import annotations

import contextlib
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elastictrain.cluster.calls import Group
from elastictrain.control.errors import AttemptFailed
from elastictrain.control.record import RunRecorder
from elastictrain.core.policy import Failure
from elastictrain.core.stragglers import StragglerWatch, ratios, straggler_remedy

PACE_STEPS = 20  # recent steps whose wall times say the run's pace


@dataclass(frozen=True)
class Named:
    step: int
    rank: int
    ratio: float
    worker_id: str
    node: str


class Stragglers:
    def __init__(self, config: Any, recorder: RunRecorder, group: Group) -> None:
        f = config.failure
        self.watch = StragglerWatch(float(f.straggler_factor), int(f.straggler_steps))
        self.replace = bool(f.replace_stragglers)
        self.avoid_s = float(f.straggler_avoid_s)
        self.min_workers = int(config.scaling.min_workers)
        self.pending: Named | None = None  # a straggler to act on after the step is recorded
        self.recorder = recorder
        self.group = group
        self.workers: list[Any] = []
        self.stages = 1
        self.even: deque[float] = deque(maxlen=PACE_STEPS)  # this attempt's steps with no rank slow (s)
        self.recent: deque[float] = deque(maxlen=PACE_STEPS)  # this attempt's steps (s)

    def attach(self, workers: list[Any], stages: int = 1) -> None:
        """A new attempt's workers, in rank order; with pipeline `stages`, a rank is compared with the
        ranks of its stage only."""
        self.workers = list(workers)
        self.stages = stages
        self.watch.forget()
        self.pending = None
        self.even.clear()
        self.recent.clear()

    def note(self, index: int, results: list[dict[str, Any]], wall_s: float = 0.0) -> dict[str, float]:
        seconds = {int(r["rank"]): float(r["forward_s"]) for r in results if r.get("forward_s")}
        if len(seconds) < 2:
            return {}
        by_rank = ratios(seconds, self.stages)
        if wall_s > 0:
            self.recent.append(wall_s)
            if max(by_rank.values()) <= self.watch.factor:
                self.even.append(wall_s)
        for rank, ratio in self.watch.observe_ratios(by_rank):
            self._name(index + 1, rank, ratio)
        return {"straggler_ratio": max(by_rank.values())}

    def _name(self, step: int, rank: int, ratio: float) -> None:
        worker = self.workers[rank] if rank < len(self.workers) else None
        worker_id = getattr(worker, "worker_id", f"rank {rank}")
        node = getattr(worker, "node_id", "") or "?"
        w = self.watch
        self.recorder.event(
            "straggler",
            f"rank {rank} (worker {worker_id}, node {node[:12]}) is a straggler: its forward passes took "
            f"{ratio:.2f}x the other ranks' median for {w.steps} steps (failure.straggler_factor={w.factor})",
            style="yellow",
            step=step,
            rank=rank,
            worker=worker_id,
            node=node,
            ratio=round(ratio, 3),
        )
        named = [*self.recorder.run_dir.read_info().extra.get("stragglers", [])]
        named.append(
            {"step": step, "rank": rank, "worker": worker_id, "node": node, "ratio": round(ratio, 3)}
        )
        with contextlib.suppress(OSError):  # disk full: the event has it; training goes on
            self.recorder.run_dir.set_extra("stragglers", named[-20:])
        if self.replace:
            self.pending = Named(step, rank, ratio, worker_id, node)

    def replace_named(self, spare_ready: Callable[[], bool]) -> None:
        """With failure.replace_stragglers, once the step that named one is recorded: replace it with a
        warm spare or drop it where the smaller world is faster (the attempt ends; the others go on from
        memory, as after a lost worker), else keep it and say why."""
        named, self.pending = self.pending, None
        if named is None:
            return
        steps = list(self.recent)[-self.watch.steps :]
        even = list(self.even)  # this attempt's steps with no rank slow: the pace without it
        remedy = straggler_remedy(
            world=len(self.workers),
            min_workers=self.min_workers,
            spare_ready=spare_ready(),
            now_s=statistics.median(steps) if steps else 0.0,
            even_s=statistics.median(even) if len(even) >= 3 else None,
            ratio=named.ratio,
        )
        if remedy.action == "keep":
            self.recorder.event(
                "straggler_kept",
                f"straggler rank {named.rank} (worker {named.worker_id}) kept: {remedy.why}",
                style="yellow",
                step=named.step,
                rank=named.rank,
                worker=named.worker_id,
                why=remedy.why,
            )
            return
        if named.node != "?" and self.avoid_s > 0:
            self.group.avoid_node(named.node, self.avoid_s)
        action = "replaced by a warm spare" if remedy.action == "replace" else "dropped"
        raise AttemptFailed(
            Failure(
                "straggler",
                (named.worker_id,),
                named.step,
                f"rank {named.rank} at {named.ratio:.2f}x the others: {action} ({remedy.why}); "
                f"node {named.node[:12]} avoided for new workers for {self.avoid_s:.0f}s",
            )
        )
