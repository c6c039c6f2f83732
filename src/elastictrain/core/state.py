"""The run's lifecycle: its states and the table of moves the controller may make, each with its cause.

The table controls the loop rather than records it: a move not listed raises, so a loop that, say,
resizes while recovering or runs again after finishing is a failing test, not a wrong run.json.
"""

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


S = RunStatus
TERMINAL = frozenset({S.FINISHED, S.FAILED})
# States a driver is in while it holds the run (a failure or a stop may strike in any of them).
ACTIVE = frozenset({S.STARTING, S.RUNNING, S.RECOVERING, S.RESIZING, S.WAITING})

# (from, to): why the controller makes that move. Nothing else is allowed.
TRANSITIONS: dict[tuple[RunStatus, RunStatus], str] = {
    (S.CREATED, S.STARTING): "a driver takes the new run up",
    (S.STOPPED, S.STARTING): "resumed after a stop or a lost driver",
    (S.FAILED, S.STARTING): "resumed after a failure, once fixed",
    (S.FINISHED, S.STARTING): "resumed with a larger training.max_steps",
    # A driver killed outright records no end: the run.json it left says the state it was in.
    **{(s, S.STARTING): "resumed after its driver was killed" for s in ACTIVE - {S.STARTING}},
    (S.STARTING, S.RUNNING): "the first attempt is set up",
    (S.STARTING, S.WAITING): "fewer workers than scaling.min_workers: waiting for capacity",
    (S.STARTING, S.FINISHED): "resumed at a checkpoint that already holds training.max_steps",
    (S.RUNNING, S.RECOVERING): "a worker or node failed, hung or ran out of memory",
    (S.RUNNING, S.RESIZING): "capacity came back: growing at a checkpoint or from memory",
    (S.RUNNING, S.FINISHED): "the checkpoint at training.max_steps is committed",
    (S.RECOVERING, S.RUNNING): "the attempt after a failure is set up",
    (S.RECOVERING, S.WAITING): "after a failure, fewer workers than scaling.min_workers",
    (S.RESIZING, S.RUNNING): "the attempt at the new world size is set up",
    (S.RESIZING, S.WAITING): "the capacity a grow counted on went away again",
    (S.WAITING, S.RUNNING): "capacity came: an attempt is set up",
    # A set-up can fail before the attempt runs: then the failure's recovery starts from there.
    (S.STARTING, S.RECOVERING): "the first attempt's set-up failed",
    (S.RESIZING, S.RECOVERING): "the grown attempt's set-up failed",
    (S.WAITING, S.RECOVERING): "the attempt set up after waiting failed",
    # How a run ends other than finishing: from any state a driver holds, or before one held it.
    **{(s, S.FAILED): "an error no recovery handles" for s in ACTIVE | {S.CREATED}},
    **{(s, S.STOPPED): "Ctrl-C or SIGTERM" for s in ACTIVE},
    (S.FINISHED, S.FAILED): "opened again, its final checkpoint does not verify",
}


class InvalidTransition(RuntimeError):
    pass


def allowed_from(current: RunStatus) -> list[RunStatus]:
    return [to for (frm, to) in TRANSITIONS if frm is current]


def transition(current: RunStatus, target: RunStatus) -> RunStatus:
    """`target`, when the table allows the move from `current` (staying is always allowed); else raise."""
    if current is target or (current, target) in TRANSITIONS:
        return target
    allowed = ", ".join(s.value for s in allowed_from(current)) or "none (the run is over)"
    raise InvalidTransition(f"run status {current.value} cannot become {target.value}; allowed: {allowed}")
