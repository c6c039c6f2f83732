"""Steps the ranks did not apply: their loss or gradients were not finite (or fp16's loss scale
overflowed). The batch is skipped, not retried: the next step reads the next samples, as at any world
size, so the run stays exact; the step, its samples and which ranks saw a non-finite loss are an event,
a terminal line, a counter in run.json (`elastictrain status`) and an MLflow metric.

`failure.max_bad_steps` such steps in a row, or a loss spike with `failure.loss_spike`, roll the run back
to a state before them (core/bad_steps.py decides); their batches are then skipped on purpose: run.json's
`skip_steps`, which every replay (a restart, a resume) passes to the workers."""

from __future__ import annotations

import contextlib
import math
from typing import Any

from elastictrain.checkpoint.store import CheckpointStore
from elastictrain.control.errors import RollBackDue, RunFailed
from elastictrain.control.record import RunRecorder
from elastictrain.core.bad_steps import BadStepWatch, GiveUp, RollBack
from elastictrain.core.checkpoints import newest_at_or_before

SAMPLES_NAMED = 8  # sample ids per step in an error message (events.jsonl has them all)


class BadSteps:
    def __init__(self, config: Any, recorder: RunRecorder, store: CheckpointStore) -> None:
        f = config.failure
        self.recorder = recorder
        self.store = store  # the run's checkpoints: the error that stops a run names the last good one
        info = recorder.run_dir.read_info()
        self.skipped = info.skipped_steps
        self.counted: set[int] = set(info.extra.get("bad_steps", []))  # steps already counted as skipped
        self.skip: set[int] = set(info.extra.get("skip_steps", []))  # steps the workers skip on purpose
        self.fp16 = config.training.precision == "fp16"
        self.watch = BadStepWatch(
            int(f.max_bad_steps), int(f.bad_steps_window), float(f.loss_spike), int(f.loss_spike_window)
        )
        self.watch.rollbacks = [tuple(r) for r in info.extra.get("rollbacks", [])]
        # Sample ids of the steps a rollback may name (not applied, or a spike), for its messages.
        self.samples: dict[int, dict[int, list[int]]] = {}
        self.pending: RollBack | GiveUp | None = None

    def note(self, index: int, results: list[dict[str, Any]], loss: float = math.nan) -> dict[str, float]:
        """After step `index` (0-based), whose recorded loss is `loss`: the skipped-steps counter, as a
        metric; an event if this step was not applied; a rollback to make once the step is recorded
        (`roll_back_if_due`)."""
        step = index + 1
        applied = all(bool(r.get("update_applied", True)) for r in results)
        if applied:  # the common case: only the spike watch looks at it
            self.pending = self.watch.observe(step, applied=True, loss=loss)
            if self.pending is not None:
                self._remember(step, results)
            return {"skipped_steps": float(self.skipped)} if self.skipped else {}
        by_rank = sorted(results, key=lambda r: r["rank"])
        on_purpose = any(r.get("skipped") for r in results)
        non_finite = [r["rank"] for r in by_rank if not math.isfinite(float(r.get("loss", 0.0)))]
        # fp16's scaler skips steps whose scaled gradients overflow while it calibrates: not a bad state.
        counts = not on_purpose and not (self.fp16 and not non_finite)
        self.pending = self.watch.observe(step, applied=False, loss=loss, counts=counts)
        samples = self._remember(step, results)
        if on_purpose or step in self.counted:
            return {"skipped_steps": float(self.skipped)} if self.skipped else {}
        skipped_ranks = [r["rank"] for r in by_rank if not r.get("update_applied", True)]
        self.skipped += 1
        self.counted.add(step)
        if non_finite or not self.fp16:  # replays skip it too, so the run stays the same at any restart
            self.skip.add(step)
        why = (
            f"rank(s) {non_finite} computed a non-finite loss"
            if non_finite
            else "its gradients were not finite (or fp16's loss scale overflowed)"
        )
        self.recorder.event(
            "bad_step",
            f"step {step} was not applied: {why}; its {sum(map(len, samples.values()))} samples are skipped, "
            f"not retried ({self.skipped} step(s) skipped so far)",
            style="yellow",
            step=step,
            non_finite_loss_ranks=non_finite,
            skipped_ranks=skipped_ranks,
            samples=samples,
            skipped_steps=self.skipped,
        )
        self._save()
        return {"skipped_steps": float(self.skipped)}

    def _remember(self, step: int, results: list[dict[str, Any]]) -> dict[int, list[int]]:
        """Keep step `step`'s sample ids by rank (the last 64 steps' at most) and return them."""
        samples = {r["rank"]: list(r.get("sample_ids", [])) for r in sorted(results, key=lambda r: r["rank"])}
        self.samples = {s: v for s, v in self.samples.items() if step - 64 < s < step}
        self.samples[step] = samples
        return samples

    def first_bad(self) -> int | None:
        """The first step of the bad steps in a row now (the newest checkpoint before it is kept), or None."""
        return self.watch.first_bad()

    def roll_back_if_due(self) -> None:
        """Once the step that called for it is recorded: raise RollBackDue (the loop rolls back), or
        RunFailed when a rollback recurs within failure.bad_steps_window."""
        decision, self.pending = self.pending, None
        if decision is None:
            return
        steps = ", ".join(map(str, decision.steps))
        named = "; ".join(
            f"step {s}: {_some(self.samples.get(s, {}))}" for s in decision.steps[:SAMPLES_NAMED]
        )
        if isinstance(decision, GiveUp):
            raise RunFailed(
                f"step(s) {steps} call for a rollback ({decision.detail}) within "
                f"failure.bad_steps_window of the one for step(s) {', '.join(map(str, decision.earlier))}: "
                f"the state or the data stays bad after a rollback, so the run stops. Samples (rank: ids): "
                f"{named}. The last checkpoint from before them: {self._good_before(decision.steps[0])}; "
                "the batches skipped so far are in run.json's skip_steps, which a resume skips too"
            )
        self.skip.update(decision.steps)
        if decision.cause == "loss_spike" and decision.first not in self.counted:
            self.skipped += 1  # the spike's update was applied; the rollback undoes it
            self.counted.add(decision.first)
        self._save()
        raise RollBackDue(decision.steps, decision.cause, f"{decision.detail}; samples (rank: ids): {named}")

    def _good_before(self, step: int) -> str:
        return newest_at_or_before(self.store.listing().committed, step - 1) or "none"

    def _save(self) -> None:
        with contextlib.suppress(OSError):  # disk full: the events have it; training goes on
            self.recorder.update(skipped_steps=self.skipped)
            self.recorder.run_dir.set_extra("bad_steps", sorted(self.counted))
            self.recorder.run_dir.set_extra("skip_steps", sorted(self.skip))
            self.recorder.run_dir.set_extra("rollbacks", [list(r) for r in self.watch.rollbacks])


def _some(samples: dict[int, list[int]]) -> str:
    return ", ".join(
        f"{rank}: {ids[:4]}{'...' if len(ids) > 4 else ''}" for rank, ids in sorted(samples.items())
    )
