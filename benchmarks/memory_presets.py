"""In-memory snapshots at the 30M and 125M presets, at default settings (opt-in: `--only memory_presets`,
about 15 minutes on 2 cores).

Per preset, on 2 workers (min 1):
- a run at default settings (`checkpoint.memory_every_steps=1`, `checkpoint.memory_max_step_share=0.03`)
  long enough for the schedule to decide (DEFAULT_RUN_STEPS), whose last worker is
  killed 3 steps before the end: the steps that failure lost, where it recovered from, and every move
  of the snapshot interval with the cost the controller measured;
- a run with a snapshot every other step: the steps a copy runs beside against the steps without, in
  the same minutes on the same workers (what the memory_recovery benchmark measures on the tiny model).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from benchmarks import memory_recovery, recovery
from benchmarks.common import SMOKE, Result, Target, Workload, median
from benchmarks.scale import preset_overrides

SIZES = ("30m", "125m")
# The kill comes 3 steps before the end. At 30M the schedule has had its 8 probes by then (it compares
# one step in 10 that has no copy beside it with the steps around it, and counts the comparisons from
# the 8th, at the end of a window): with disk checkpoints every 5 steps (not probes), about 115 steps.
# At 125M 30 steps: the memory check decides at the first copy.
DEFAULT_RUN_STEPS = {"30m": 130, "125m": 30, "smoke": 6}
INTERLEAVED_STEPS = {"30m": 18, "125m": 14, "smoke": 6}


def workload(size: str, smoke: bool, steps: int) -> Workload:
    overrides = preset_overrides(size) if not smoke else SMOKE.overrides
    name = f"memory-{size}" if not smoke else "memory-smoke"
    return Workload(name, overrides, warmup_steps=2, measured_steps=steps - 2, peer_timeout_s=3600)


def measure(size: str, tmp: Path, smoke: bool) -> dict[str, Any]:
    steps = DEFAULT_RUN_STEPS["smoke" if smoke else size]
    killed = recovery.elastictrain_worker_killed(workload(size, smoke, steps), tmp / f"{size}-killed")
    lost = killed["steps_lost"]
    print(f"  memory_presets {size}: killed at default settings: {lost} step(s) lost", flush=True)
    n = INTERLEAVED_STEPS["smoke" if smoke else size]
    paired = memory_recovery.interleaved_cost(workload(size, smoke, n), tmp / f"{size}-interleaved", n)
    if math.isfinite(paired["copy_s"]):
        print(f"  memory_presets {size}: a step beside a snapshot {paired['cost']:+.1%}", flush=True)
    else:  # snapshots were off: the steps compared differ only by noise
        print(f"  memory_presets {size}: a step beside a snapshot: not measured (no copy made)", flush=True)
    return {"size": size, "killed": killed, "interleaved": paired}


def _kill_runs_off(runs: list[dict[str, Any]]) -> str:
    """Why the kill runs' snapshots went off, if they did ("" otherwise)."""
    off = [why for r in runs for _, _, why in r["killed"]["snapshot_intervals"] if "off until" in why]
    return off[-1] if off else ""


def _last_window(windows: list[dict[str, Any]]) -> str:
    """What the schedule measured in its last window, for a target's note ("" when it measured none)."""
    if not windows:
        return ""
    last = windows[-1]
    costs = [
        f"{k} {last[k]:.3f} s"
        for k in ("cpu_cost_s", "wait_cost_s", "wall_cost_s")
        if last.get(k) is not None
    ]
    step, compared = f"{last['step_s']:.2f} s", last["comparisons"]
    return f"; its last window: a step {step}, {', '.join(costs)} ({compared} probe comparisons)"


def run(w: Workload, tmp: Path, reps: int, smoke: bool) -> Result:
    sizes = SIZES if not smoke else ("smoke",)
    runs = [measure(size, tmp / f"rep{rep}", smoke) for rep in range(reps) for size in sizes]
    metrics: dict[str, Any] = {}
    targets: list[Target] = []
    for size in sizes:
        mine = [r for r in runs if r["size"] == size]
        intervals = [i for r in mine for _, i, _ in r["killed"]["snapshot_intervals"]]
        copied = [r for r in mine if math.isfinite(r["interleaved"]["copy_s"])]  # else no copy was made
        # Why the paired run made no copy (older results did not record it: the kill run's reason).
        paired_off = [r["interleaved"]["off"] for r in mine if r["interleaved"].get("off")]
        paired_off = paired_off or [_kill_runs_off(mine) or "why was not recorded in this result"]
        m = {
            "steps_lost": median([r["killed"]["steps_lost"] for r in mine]),
            "recovered_from": [r["killed"]["recovered_from"] for r in mine],
            "interval_moves": [r["killed"]["snapshot_intervals"] for r in mine],
            "interval_at_the_end": intervals[-1] if intervals else 1,
            "snapshots_off": _kill_runs_off(mine),
            "step_cost_interleaved": median([r["interleaved"]["cost"] for r in copied]) if copied else None,
            "step_s_without": median([r["interleaved"]["step_s_without"] for r in mine]),
            "copy_s": median([r["interleaved"]["copy_s"] for r in mine]),
            "replicate_s": median([r["interleaved"]["replicate_s"] for r in mine]),
            # Each window the default schedule measured in the killed run (the last repetition's).
            "schedule_windows": mine[-1]["killed"].get("snapshot_windows", []),
        }
        metrics[size] = m
        targets += [
            Target(
                f"{size} at default settings: steps lost per failure",
                m["steps_lost"],
                1,
                "<=",
                unit="steps",
                note=f"from {m['recovered_from']}; snapshots every {m['interval_at_the_end']} step(s) when "
                f"the worker was killed (the schedule's moves: {len(intervals)})"
                + _last_window(m["schedule_windows"])
                + (f"; snapshots were off: {m['snapshots_off']}" if m["snapshots_off"] else ""),
            ),
            Target(
                f"{size}: per-step cost of a snapshot, beside steps without (wall, one run)",
                m["step_cost_interleaved"],
                0.03,
                "<=",
                unit="fraction",
                note=f"2 ranks, a snapshot every other step, {mine[-1]['interleaved']['steps']} steps; "
                f"a step without {m['step_s_without']:.2f} s"
                + (f"; not measured: no copy was made ({paired_off[-1]})" if not copied else ""),
            ),
        ]
    notes = [
        "The kill comes 3 steps before the end of a run of "
        + ", ".join(f"{DEFAULT_RUN_STEPS[s]} steps at {s}" for s in sizes)
        + ", after the default schedule had its windows of 20 snapshots (and at 30M its 8 probes) to decide "
        "from; steps lost from memory are at most the interval it chose, which the interval_moves list with "
        "the cost the controller measured.",
    ]
    if smoke:
        notes.append("smoke: the benchmarks' smallest workload, not a preset: not a measurement.")
    return Result("memory_presets", smoke, reps, metrics, targets, runs, notes, {"sizes": list(sizes)})


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = result["metrics"]
    sizes = list(m)
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    axes[0].bar(sizes, [100 * (m[s]["step_cost_interleaved"] or 0.0) for s in sizes])
    axes[0].axhline(3, color="red", linestyle="--", label="target 3%")
    axes[0].set_ylabel("% longer beside a snapshot")
    axes[0].legend()
    axes[1].bar(sizes, [m[s]["steps_lost"] for s in sizes])
    axes[1].axhline(1, color="red", linestyle="--", label="target 1")
    axes[1].set_ylabel("steps lost (default settings)")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
