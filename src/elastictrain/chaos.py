"""Controller hooks for fault injection and observation: used by the tests, benchmarks and chaos runs.

Each hook is a function of the controller, applied before the run starts (`run_training(...,
controller_hook=...)`); `at_step` runs an action (kill a worker, remove a node) at a chosen step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def at_step(step: int, action: Callable[[Any], None]) -> Callable[[Any], None]:
    """A controller hook running `action(controller)` once, right after `step` steps are reported."""

    def hook(controller: Any) -> None:
        original = controller._report
        fired = []

        def report(s: int, results: list[dict[str, Any]]) -> None:
            original(s, results)
            if controller.step == step and not fired:
                fired.append(True)
                action(controller)

        controller._report = report

    return hook


def record_losses(losses: list[float]) -> Callable[[Any], None]:
    """A controller hook appending each reported step's mean loss."""

    def hook(controller: Any) -> None:
        original = controller._report

        def report(s: int, results: list[dict[str, Any]]) -> None:
            losses.append(sum(r["loss"] for r in results) / len(results))
            original(s, results)

        controller._report = report

    return hook


def chain(*hooks: Callable[[Any], None]) -> Callable[[Any], None]:
    def hook(controller: Any) -> None:
        for h in hooks:
            h(controller)

    return hook


def wait_until_replacements_are_warm(controller: Any) -> None:
    """Block the driver until started replacement actors finished warming up (so a grow can happen)."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        controller._start_new_workers()
        controller.group.poll_warm(timeout_s=1.0)
        if not controller.group.pending and not controller.group.warming:
            return
    raise TimeoutError("replacement workers did not warm up in 180s")
