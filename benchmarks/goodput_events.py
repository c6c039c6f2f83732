"""What the goodput benchmark reads from an elastictrain run's events: each restart's cause, cost and
set-up parts, where the longest grow's stall went, and each move of the snapshot schedule."""

from __future__ import annotations

from typing import Any

# What a recovery's record keeps of its `recovered` event and of the `attempt_started` before it.
RECOVERED_FIELDS = ("step", "recovered_from", "steps_lost", "recovery_seconds", "stall_s")
SET_UP_FIELDS = (
    "setup_s",
    "process_group_s",
    "engine_s",
    "load_s",
    "setup_s_by_rank",
    "load_fetch_s_by_rank",
)


def recoveries(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each restart's record: its cause (failure or grow), what it cost, and where a stall went: the
    set-up's parts on its slowest rank, the seconds from the cause's event to the new attempt's start
    (`to_attempt_s`: leaving the old attempt and setting up) and from there to the first step's end."""
    from datetime import datetime

    def at(e: dict[str, Any]) -> float:
        return datetime.fromisoformat(e["time"]).timestamp()

    out: list[dict[str, Any]] = []
    cause: dict[str, Any] | None = None
    started: dict[str, Any] | None = None
    for e in events:
        if e["event"] in ("failure", "grow"):
            cause, started = e, None
        elif e["event"] == "attempt_started":
            started = e
        elif e["event"] == "recovered":
            record = {k: e.get(k) for k in RECOVERED_FIELDS}
            record["cause"] = cause["event"] if cause else "start"
            if started is not None:
                record.update({k: started.get(k) for k in SET_UP_FIELDS})
                record["to_attempt_s"] = at(started) - at(cause) if cause else None
                record["first_step_s"] = at(e) - at(started)
            out.append(record)
    return out


def slowest_grow_note(grows: list[dict[str, Any]]) -> str:
    """Where the longest grow's stall went, from its events (empty for results without the set-up parts)."""
    timed = [g for g in grows if g.get("stall_s") is not None and g.get("to_attempt_s") is not None]
    if not timed:
        return ""
    g = max(timed, key=lambda g: g["stall_s"])
    return (
        f"; the longest (step {g['step']}): {g['to_attempt_s']:.2f} s from the grow to the new attempt "
        f"(set-up {g['setup_s']:.2f} s on its slowest rank: process group {g['process_group_s']:.2f}, engine "
        f"{g['engine_s']:.2f}, load {g['load_s']:.2f}; by rank {g['setup_s_by_rank']}), then "
        f"{g['first_step_s']:.2f} s to its first step's end"
    )


def snapshot_changes(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each move of the in-memory snapshot schedule: its step, the new interval (or off), and why."""
    return [
        {k: e.get(k) for k in ("step", "interval", "off", "message")}
        for e in events
        if e["event"] == "snapshots"
    ]
