"""The run's lifecycle states and which transitions the controller may make."""

from __future__ import annotations

from enum import Enum


class RunStatus(str, Enum):
    CREATED = "CREATED"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"
    RESIZING = "RESIZING"
    WAITING = "WAITING"
    FINISHED = "FINISHED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"


_ACTIVE = {RunStatus.STARTING, RunStatus.RUNNING, RunStatus.RECOVERING, RunStatus.RESIZING, RunStatus.WAITING}
TERMINAL = frozenset({RunStatus.FINISHED, RunStatus.FAILED})

ALLOWED: dict[RunStatus, frozenset[RunStatus]] = {
    RunStatus.CREATED: frozenset({RunStatus.STARTING, RunStatus.FAILED}),
    # STOPPED (driver lost or interrupted) and FAILED runs can be resumed.
    RunStatus.STOPPED: frozenset({RunStatus.STARTING, RunStatus.FAILED}),
    RunStatus.FAILED: frozenset({RunStatus.STARTING}),
    # A finished run continues only when `resume RUN_DIR training.max_steps=N` extends it.
    RunStatus.FINISHED: frozenset({RunStatus.STARTING}),
    **{s: frozenset(_ACTIVE | TERMINAL | {RunStatus.STOPPED}) - {RunStatus.CREATED} for s in _ACTIVE},
}


class InvalidTransition(RuntimeError):
    pass


def transition(current: RunStatus, target: RunStatus) -> RunStatus:
    if target not in ALLOWED[current]:
        allowed = ", ".join(sorted(s.value for s in ALLOWED[current])) or "none (the run is over)"
        raise InvalidTransition(
            f"run status {current.value} cannot become {target.value}; allowed: {allowed}"
        )
    return target
