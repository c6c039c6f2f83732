"""Steps the ranks did not apply: their loss or gradients were not finite (or fp16's loss scale
overflowed). The batch is skipped, not retried: the next step reads the next samples, as at any world
size, so the run stays exact; the step, its samples and which ranks saw a non-finite loss are an event,
a terminal line, a counter in run.json (`elastictrain status`) and an MLflow metric."""

from __future__ import annotations

import math
from typing import Any

from elastictrain.control.record import RunRecorder


class BadSteps:
    def __init__(self, recorder: RunRecorder) -> None:
        self.recorder = recorder
        self.skipped = recorder.run_dir.read_info().skipped_steps

    def note(self, index: int, results: list[dict[str, Any]]) -> dict[str, float]:
        """After step `index` (0-based): the skipped-steps counter, as a metric; an event if this step
        was not applied. Ranks disagreeing would leave their weights apart: that stops the attempt."""
        applied = [bool(r.get("update_applied", True)) for r in results]
        if all(applied):
            return {"skipped_steps": float(self.skipped)} if self.skipped else {}
        step = index + 1
        by_rank = sorted(results, key=lambda r: r["rank"])
        non_finite = [r["rank"] for r in by_rank if not math.isfinite(float(r.get("loss", 0.0)))]
        skipped_ranks = [r["rank"] for r in by_rank if not r.get("update_applied", True)]
        samples = {r["rank"]: list(r.get("sample_ids", [])) for r in by_rank}
        self.skipped += 1
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
        self.recorder.update(skipped_steps=self.skipped)
        return {"skipped_steps": float(self.skipped)}
