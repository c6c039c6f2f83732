"""A control loop on the fake worker group (testing/fake_group.py): a whole run in milliseconds, no Ray."""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastictrain.checkpoint.store import CheckpointStore
from elastictrain.config import config_digest, load_config, to_yaml
from elastictrain.control.loop import Controller, RunSummary
from elastictrain.control.progress import Reporter
from elastictrain.rundir.run_dir import RunDir
from elastictrain.testing.fake_group import FakeGroup
from elastictrain.tracking.tracker import NullTracker

TINY = Path(__file__).resolve().parents[2] / "conf" / "tiny-cpu.yaml"


class Clock:
    """Time that moves only when read: every reading is a tenth of a second later."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 0.1
        return self.now


@dataclass
class Run:
    controller: Controller
    group: FakeGroup
    run_dir: RunDir
    terminal: io.StringIO

    def run(self) -> RunSummary:
        return self.controller.run()

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.run_dir.read_events() if name is None or e["event"] == name]

    def committed_step(self) -> int | None:
        last = CheckpointStore(self.run_dir.checkpoints_dir).latest_committed()
        return None if last is None else int(last.manifest["step"])

    @property
    def status(self) -> str:
        return self.run_dir.read_info().status


def make_run(
    tmp_path: Path,
    *overrides: str,
    capacity: int = 2,
    run_dir: RunDir | None = None,
    layouts: Callable[[Any], Any] | None = None,
    stages: Any = None,
) -> Run:
    """12 steps, a checkpoint every 4, 2 workers (unless overridden), on `capacity` fake worker slots.
    `layouts(config)`: with auto layout fields, resolves them as the driver's start does and returns the
    chooser the loop asks again."""
    cfg = load_config(
        TINY,
        [
            f"run.dir={tmp_path}/run",
            "training.max_steps=12",
            "checkpoint.every_steps=4",
            "failure.max_failures=3",
            # A fake step takes no time: no cost to measure, so every step is snapshotted (the schedule
            # that spaces them out by their cost has its own tests: test_snapshot_schedule.py).
            "checkpoint.memory_max_step_share=0",
            *overrides,
        ],
    )
    if run_dir is None:
        run_dir = RunDir.create(
            tmp_path / "run", name="fake", config_yaml=to_yaml(cfg), config_digest=config_digest(cfg)
        )
    group = FakeGroup(capacity)
    terminal = io.StringIO()
    reporter = Reporter(cfg.training.max_steps, stream=terminal, live=False)
    chooser = layouts(cfg) if layouts else None
    controller = Controller(
        cfg, run_dir, NullTracker(), reporter, group, clock=Clock(), layouts=chooser, stages=stages
    )
    return Run(controller, group, run_dir, terminal)


def at_step(step: int, action: Any) -> Any:
    """An after-step callback running `action(controller)` once `step` steps are done."""
    fired: list[bool] = []

    def callback(controller: Any, _index: int, _results: Any) -> None:
        if controller.step == step and not fired:
            fired.append(True)
            action(controller)

    return callback
