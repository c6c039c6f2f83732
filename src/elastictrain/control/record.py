"""The run recorder: the one writer of a run's events, run.json and tracker, for the Ray loop and --local.

A full disk must not stop training: an event or run.json update that cannot be written is logged
and training goes on (the terminal and MLflow still get the event). Status changes follow the run's
state machine (core/state.py).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import Any

from elastictrain.control.progress import Reporter
from elastictrain.core.state import RunStatus, transition
from elastictrain.core.step_cost import StepCosts
from elastictrain.rundir.run_dir import RunDir
from elastictrain.tracking.tracker import Tracker

log = logging.getLogger("elastictrain.controller")


class RunRecorder:
    def __init__(self, run_dir: RunDir, tracker: Tracker, reporter: Reporter) -> None:
        self.run_dir = run_dir
        self.tracker = tracker
        self.reporter = reporter
        info = run_dir.read_info()
        self.status = RunStatus(info.status)
        self.failures = info.failures
        # MLflow holds each step's metrics once. The spool knows every step it took, even one whose
        # run.json update a killed driver did not get to write.
        self.logged_step = max(info.logged_step, getattr(tracker, "logged_step", 0))
        self.costs = StepCosts()  # this driver's steps: engine time and what surrounds it

    def event(self, name: str, message: str = "", style: str = "", *, step: int, **fields: Any) -> None:
        try:
            record = self.run_dir.append_event(name, step=step, message=message, **fields)
        except OSError as e:  # a full disk must not stop training: the terminal and MLflow still get it
            log.warning("could not append to %s: %s", self.run_dir.events_path, e)
            record = {"event": name, "step": step, "message": message, **fields}
        self.tracker.log_event(record)
        if message:
            self.reporter.event(message, style)
        log.info("%s %s", name, message)

    def quiet_event(self, name: str, **fields: Any) -> None:
        """An event for events.jsonl only (no terminal line, no MLflow event)."""
        try:
            self.run_dir.append_event(name, **fields)
        except OSError as e:
            log.warning("could not append to %s: %s", self.run_dir.events_path, e)

    def set_status(self, status: RunStatus, message: str | None = None, *, step: int) -> None:
        """A move of the run's state machine; one it does not allow is a bug of the loop and raises."""
        if status is not self.status:
            transition(self.status, status)
        self._write_status(status, message, step)

    def begin(self, *, step: int, nothing_to_train: bool) -> None:
        """A driver takes the run up: STARTING, unless it finished and there is nothing to train
        (e.g. `fit` called again on a finished run), which stays FINISHED."""
        if not (self.status is RunStatus.FINISHED and nothing_to_train):
            self.set_status(RunStatus.STARTING, step=step)

    def record_end(self, status: RunStatus, message: str, *, step: int) -> None:
        """How the run ended (failed, stopped), whatever state a driver held it in when that struck; a
        stop after the last checkpoint committed leaves the run FINISHED."""
        if self.status is RunStatus.FINISHED and status is RunStatus.STOPPED:
            log.warning("run finished before it %s: %s", status.value.lower(), message)
            return
        self.set_status(status, message, step=step)

    def _write_status(self, status: RunStatus, message: str | None, step: int) -> None:
        self.status = status
        self.update(status=status.value, message=message, last_step=step, failures=self.failures)

    def update(self, **changes: Any) -> None:
        try:
            self.run_dir.update(**changes)
        except OSError as e:  # disk full: run.json keeps its last good content; training goes on
            log.warning("could not update %s: %s", self.run_dir.run_json, e)

    def record_world_size(self, step: int, size: int, reason: str) -> None:
        try:
            self.run_dir.record_world_size(step, size, reason)
        except OSError as e:  # disk full: the history misses an entry (events.jsonl has it); training goes on
            log.warning("could not record world size %d in %s: %s", size, self.run_dir.run_json, e)

    def metrics(self, metrics: dict[str, float], *, step: int) -> None:
        self.tracker.log_metrics(metrics, step=step)

    def step_metrics(self, step: int, metrics: dict[str, float], *, log_every: int) -> None:
        """A step's metrics: to MLflow once per step (a step redone after a failure logs only its
        recovery figures), to the terminal, and into run.json."""
        if step > self.logged_step:
            self.tracker.log_metrics(metrics, step=step)
            self.logged_step = step
            self.costs.add(metrics.get("step_time_s", 0.0), metrics.get("engine_s", 0.0))
        else:  # redone after a failure: its metrics were logged the first time (nearly equal values)
            extra: dict[str, float] = {
                k: metrics[k]
                for k in ("recovery_seconds", "steps_lost", "recovered_from_memory")
                if k in metrics
            }
            if extra:
                self.tracker.log_metrics(extra, step=step)
        self.reporter.step(step, metrics, log_line=step % log_every == 0)
        self.update(
            last_step=step,
            logged_step=self.logged_step,
            last_metrics={k: round(v, 6) for k, v in metrics.items()},
        )

    def step_costs(self, step: int) -> None:
        """The end-of-run line: the median step, its time in the engine and around it (core/step_cost.py)."""
        if self.costs.walls:
            figures: dict[str, Any] = self.costs.figures()
            self.event("step_costs", self.costs.describe(), "", step=step, **figures)

    def history(self) -> list[int]:
        return [h["world_size"] for h in self.run_dir.read_info().world_size_history]


def ledger_from_env() -> Callable[[int, int, list[int], bool], None] | None:
    """ELASTICTRAIN_SAMPLE_LEDGER=FILE: append every reported step's sample ids (audits and chaos tests);
    a step not applied (control/bad_steps.py) has its samples marked skipped: read once, never trained."""
    path = os.environ.get("ELASTICTRAIN_SAMPLE_LEDGER")
    if not path:
        return None

    def record(step: int, rank: int, ids: list[int], skipped: bool = False) -> None:
        line = {"step": step, "rank": rank, "ids": ids, **({"skipped": True} if skipped else {})}
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")

    return record
