"""Controller hooks for fault injection and observation: used by the tests, benchmarks and chaos runs.

A hook is a function of the controller, applied before the run starts (`run_training(...,
controller_hook=...)`); it registers callbacks (control/callbacks.py) and replaces nothing.
`at_step` runs an action (kill a worker, remove a node) at a chosen step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

Hook = Callable[[Any], None]


def at_step(step: int, action: Callable[[Any], None]) -> Hook:
    """A controller hook running `action(controller)` once, right after `step` steps are reported."""

    def hook(controller: Any) -> None:
        fired: list[bool] = []

        def after_step(c: Any, _index: int, _results: list[dict[str, Any]]) -> None:
            if c.step == step and not fired:
                fired.append(True)
                action(c)

        controller.callbacks.after_step.append(after_step)

    return hook


def after_attempt_start(action: Callable[[Any], None]) -> Hook:
    """A controller hook running `action(controller)` each time an attempt's workers are set up."""

    def hook(controller: Any) -> None:
        controller.callbacks.after_attempt_start.append(action)

    return hook


def record_losses(losses: list[float]) -> Hook:
    """A controller hook appending each reported step's mean loss."""

    def hook(controller: Any) -> None:
        def after_step(_c: Any, _index: int, results: list[dict[str, Any]]) -> None:
            losses.append(sum(r["loss"] for r in results) / len(results))

        controller.callbacks.after_step.append(after_step)

    return hook


def chain(*hooks: Hook) -> Hook:
    def hook(controller: Any) -> None:
        for h in hooks:
            h(controller)

    return hook


def wait_until_replacements_are_warm(controller: Any) -> None:
    """Block the driver until started replacement actors finished warming up (so a grow can happen).

    The controller's own rule tends them meanwhile: a start past failure.warmup_timeout_s (and 3x the
    slowest finished one) is stopped and another started in its place, so a hung import or op build
    costs one timeout, not the test; this waits for at most three such rounds."""
    group = controller.group
    timeout = float(controller.cfg.failure.warmup_timeout_s)
    bound = 3 * 3 * timeout
    start = time.monotonic()
    deadline = start + bound
    while time.monotonic() < deadline:
        controller.capacity.tend_workers(controller.step)
        group.poll_warm(timeout_s=1.0)
        if not group.pending and not group.warming:
            return
        if not group.warming and not group.ready_reservations() and time.monotonic() - start > timeout:
            # Nothing to wait for: no worker starts and no reservation is placed (the cluster has no room).
            raise TimeoutError(
                f"no replacement can start: {len(group.pending)} slot(s) pending, none placed in "
                f"{timeout:.0f}s; the cluster has no free slot for them"
            )
    raise TimeoutError(
        f"replacement workers did not warm up in {bound:.0f}s: {len(group.pending)} slot(s) pending "
        f"({group.ready_reservations()} placed), warming: {[w.worker_id for w in group.warming]}, "
        f"progress: {group.progress(timeout_s=5.0)}"
    )
