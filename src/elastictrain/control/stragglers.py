"""A rank slower than the others, named with its worker and node: an event, a terminal line, run.json's
`stragglers` (shown by `elastictrain status`) and the `straggler_ratio` metric (the slowest rank's forward
time over the others' median, each step); with failure.replace_stragglers, then stopped and replaced as a
lost worker is (the others go on from memory). The rule is pure (core/stragglers.py)."""

from __future__ import annotations

import contextlib
from typing import Any

from elastictrain.control.errors import AttemptFailed
from elastictrain.control.record import RunRecorder
from elastictrain.core.policy import Failure
from elastictrain.core.stragglers import StragglerWatch, ratios


class Stragglers:
    def __init__(self, config: Any, recorder: RunRecorder) -> None:
        f = config.failure
        self.watch = StragglerWatch(float(f.straggler_factor), int(f.straggler_steps))
        self.replace = bool(f.replace_stragglers)
        self.pending: Failure | None = None  # a straggler to replace after the step is recorded
        self.recorder = recorder
        self.workers: list[Any] = []

    def attach(self, workers: list[Any]) -> None:
        """A new attempt's workers, in rank order."""
        self.workers = list(workers)
        self.watch.forget()
        self.pending = None

    def note(self, index: int, results: list[dict[str, Any]]) -> dict[str, float]:
        seconds = {int(r["rank"]): float(r["forward_s"]) for r in results if r.get("forward_s")}
        if len(seconds) < 2:
            return {}
        for rank, ratio in self.watch.observe(seconds):
            self._name(index + 1, rank, ratio)
        return {"straggler_ratio": max(ratios(seconds).values())}

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
            self.pending = Failure(
                "straggler", (worker_id,), step, f"rank {rank} at {ratio:.2f}x the others: replaced"
            )

    def replace_named(self) -> None:
        """With failure.replace_stragglers, once the step that named one is recorded: stop the attempt so the
        straggler is replaced, the others going on from memory as after a lost worker."""
        if self.pending is not None:
            failure, self.pending = self.pending, None
            raise AttemptFailed(failure)
