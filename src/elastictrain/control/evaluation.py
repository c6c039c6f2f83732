"""Validation during a run: queued on every rank behind the step it follows, reported once per step.

An evaluation reads the same validation batches every time, so one repeated after a restart or a
resize gives the same numbers (tested at world sizes 1, 2 and 3); it is logged once, like a step's
metrics. Results go to the terminal, events.jsonl (`eval`), MLflow (`eval_loss`, `eval_perplexity`,
`eval_tokens`) and run.json (`last_eval`, and `best_eval`: the lowest loss so far). With eval.prompts,
what the model says comes with it (completions.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from elastictrain.cluster.calls import Calls, Group
from elastictrain.cluster.worker_api import WorkerApi
from elastictrain.config.eval_check import evaluates
from elastictrain.control.completions import Completions
from elastictrain.control.failures import gather_results
from elastictrain.control.record import RunRecorder
from elastictrain.core.checkpoints import tag_for_step
from elastictrain.core.losses import eval_due, eval_summary, replica_results

log = logging.getLogger("elastictrain.controller")


def best_checkpoint(config: Any, recorder: RunRecorder) -> tuple[str, ...]:
    """The tag `checkpoint.keep_best` keeps out of pruning: the step of the lowest validation loss."""
    if not config.checkpoint.keep_best:
        return ()
    best = recorder.run_dir.read_info().extra.get("best_eval") or {}
    return (tag_for_step(int(best["step"])),) if "step" in best else ()


class Evaluations:
    def __init__(self, config: Any, recorder: RunRecorder) -> None:
        self.cfg = config
        self.recorder = recorder
        self.enabled = evaluates(config)
        self.pending: dict[int, Calls] = {}  # step index -> the evaluate calls queued behind it
        info = recorder.run_dir.read_info()
        self.logged_step = int(info.extra.get("last_eval", {}).get("step", 0))
        self.best: dict[str, Any] = dict(info.extra.get("best_eval", {}))
        self.completions = Completions(config, recorder) if self.enabled else None

    def due(self, step: int) -> bool:
        """Whether a validation follows step `step` (0-based)."""
        return self.enabled and eval_due(step + 1, self.cfg.eval.every_steps, self.cfg.training.max_steps)

    def submit(self, group: Group, workers: Sequence[Any], step: int) -> None:
        if self.due(step):
            self.pending[step] = group.call(workers, WorkerApi.evaluate, step)

    def forget(self) -> None:
        """A new attempt: what the last one queued will not answer."""
        self.pending.clear()

    def collect(self, group: Group, step: int) -> None:
        calls = self.pending.pop(step, None)
        if calls is None:
            return
        results = gather_results(group, calls, step, timeout_s=self.cfg.failure.hang_timeout_s, phase="eval")
        self.record(step + 1, list(results.values()))

    def record(self, step_done: int, results: list[dict[str, Any]]) -> dict[str, float]:
        """Report a validation of the model after `step_done` steps (from every rank's share)."""
        summary = eval_summary(replica_results(results))
        if step_done <= self.logged_step:  # repeated after a restart: logged the first time
            return summary
        self.logged_step = step_done
        self.recorder.metrics(summary, step=step_done)
        entry = {"step": step_done, **{k: round(v, 6) for k, v in summary.items()}}
        if not self.best or summary["eval_loss"] < float(self.best["eval_loss"]):
            self.best = entry
        for key, value in (("last_eval", entry), ("best_eval", self.best)):
            try:
                self.recorder.run_dir.set_extra(key, value)
            except OSError as e:  # a full disk must not stop training; the event and MLflow have it
                log.warning("could not record %s in run.json: %s", key, e)
        self.recorder.event(
            "eval",
            f"eval at step {step_done}: {eval_text(summary)}",
            "magenta",
            step=step_done,
            **summary,
        )
        if self.completions is not None:
            self.completions.record(step_done, results)
        return summary


def eval_text(summary: dict[str, float]) -> str:
    """A validation's line: loss and perplexity, or a preference objective's loss and reward figures."""
    loss, samples = summary["eval_loss"], int(summary["eval_samples"])
    if "eval_perplexity" in summary:
        return (
            f"loss {loss:.4f}, perplexity {summary['eval_perplexity']:.2f} "
            f"({int(summary['eval_tokens'])} tokens, {samples} samples)"
        )
    figures = ", ".join(
        f"{name} {summary[f'eval_{name}']:.3f}"
        for name in ("rewards/margins", "rewards/accuracies", "kl")
        if f"eval_{name}" in summary
    )
    return f"loss {loss:.4f}, {figures} ({samples} items)"
