"""Callbacks into a run, for fault injection (testing/chaos.py), tests and benchmarks: no private method
is replaced.

Each callback gets the controller, to look at (`step`, `world_size`, `attempt`, `active`, `group`,
`saves`) or to act on the cluster (kill a worker, remove a node). Raising from a callback ends the
run as that error would (KeyboardInterrupt: the run stops, resumable).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elastictrain.core.policy import Failure

AfterStep = Callable[[Any, int, list[dict[str, Any]]], None]  # (controller, step index, every rank's result)
AfterAttemptStart = Callable[[Any], None]  # (controller): its workers are set up, no step ran yet
OnFailure = Callable[[Any, Failure], None]  # (controller, failure): before it is handled
BeforeShutdown = Callable[[Any], None]  # (controller): the run is over, its workers still exist


@dataclass
class Callbacks:
    after_step: list[AfterStep] = field(default_factory=list)
    after_attempt_start: list[AfterAttemptStart] = field(default_factory=list)
    on_failure: list[OnFailure] = field(default_factory=list)
    before_shutdown: list[BeforeShutdown] = field(default_factory=list)
