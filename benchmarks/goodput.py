"""Goodput under failures: the fault-free time for the steps done / the wall time they took with failures.

elastictrain and Ray Train each train on a 3-node `ray.cluster_utils.Cluster` (1 CPU each) with the
same failures on the same seeded schedule of about one a minute, cycling through: a worker killed, a
node removed, the node added back. elastictrain runs 3 workers, min 1, recovering from memory (its
defaults) with disk checkpoints every `EVERY` steps; Ray Train runs `TorchTrainer` with the same
DeepSpeed step (benchmarks/peers), DeepSpeed checkpoints every `EVERY` steps reported to Ray Train,
and 3 workers fixed: a ZeRO-3 checkpoint cannot be loaded at another world size by DeepSpeed, so an
elastic Ray Train job could not resume after a node loss (recovery.json); at a fixed size it waits
for the node to come back.

Each system's fault-free step time is taken from its own run: the mean interval between consecutive
steps of one attempt at the full world size (3), which includes its disk checkpoints and in-memory
snapshots and leaves out restarts and steps at a smaller size. Goodput = steps done with failures x
that step time / the wall time from the first completed step to the last (cold starts excluded
alike): for a run that reaches its final step, the fault-free time to the final step over the wall
time with failures; a peer run stopped at its time limit is measured up to where it got.

The duration is `GOODPUT_MINUTES` (environment; default 15): the number of steps is set from
elastictrain's calibration so that its fault-free run would take that long.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    Result,
    Target,
    Workload,
    _read_lines,
    config_overrides,
    load,
    median,
    run_elastictrain,
    run_peer,
    workload_info,
)
from benchmarks.goodput_events import recoveries, slowest_grow_note, snapshot_changes

EVERY = 20  # disk checkpoint interval (steps): recovery comes from memory, the disk is the fallback
CALIBRATION_STEPS = 2 * EVERY + 1  # sizes the run: two checkpoints' pauses inside, as in the long runs
KINDS = ("worker_killed", "node_removed", "node_added")


def schedule(seconds: float, seed: int = 15, every_s: float = 60.0) -> list[tuple[float, str]]:
    """Failure times (s after the first step) and kinds: about one per `every_s`, jittered by +-30%."""
    rng = random.Random(seed)
    out, t, i = [], 0.0, 0
    while True:
        t += every_s * rng.uniform(0.7, 1.3)
        if t >= seconds * 0.9:
            return out
        out.append((t, KINDS[i % len(KINDS)]))
        i += 1


def _cluster() -> Any:
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(3):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster


def _run(w: Workload, path: Path, steps: int, plan: list[tuple[float, str]], cluster: Any) -> dict[str, Any]:
    """Train `steps` steps, applying `plan` (acted on at the first step reported after each time)."""
    cfg = load(
        config_overrides(
            w, path, "scaling.min_workers=1", "scaling.max_workers=3", f"checkpoint.every_steps={EVERY}"
        )
        + [f"training.max_steps={steps}", "failure.max_failures=1000", "failure.wait_for_capacity_s=300"]
    )
    times: list[tuple[float, int, int]] = []  # (wall time, steps done, world size)
    done: list[dict[str, Any]] = []
    pending = list(plan)

    def act(controller: Any, kind: str) -> None:
        import ray

        if kind == "worker_killed" and len(controller.active) > 1:
            ray.kill(controller.active[-1].actor)
        elif kind == "node_removed" and len(controller.active) > 1:
            node_id = controller.active[0].node_id
            node = next((n for n in cluster.worker_nodes if n.node_id == node_id), None)
            if node is not None:
                cluster.remove_node(node)
        elif kind == "node_added" and len(cluster.worker_nodes) < 3:
            cluster.add_node(num_cpus=1)
        else:
            return
        done.append({"time": time.time(), "kind": kind, "step": controller.step})

    def after_step(controller: Any, _index: int, _results: Any) -> None:
        now = time.time()
        times.append((now, controller.step, controller.world_size))
        while pending and now - times[0][0] >= pending[0][0]:
            _, kind = pending.pop(0)
            act(controller, kind)

    def hook(controller: Any) -> None:
        controller.callbacks.after_step.append(after_step)

    run_dir = run_elastictrain(cfg, hook)
    events = run_dir.read_events()
    return {
        "steps": steps,
        "timeline": [(t - times[0][0], s, ws) for t, s, ws in times],
        "seconds": times[-1][0] - times[0][0],
        "failures": [{**f, "time": f["time"] - times[0][0]} for f in done],
        "recovered": recoveries(events),
        "snapshot_changes": snapshot_changes(events),
    }


def _ray_train(
    w: Workload, tmp: Path, steps: int, plan: list[tuple[float, str]], limit_s: float
) -> dict[str, Any]:
    """Ray Train on a 3-node cluster of its own (benchmarks/peers/ray_train.py applies `plan`)."""
    spec = {
        "steps": steps,
        "ckpt_every": EVERY,
        "max_failures": 1000,
        "resume_dir": str(tmp / "ckpt"),
        "cluster_nodes": 3,
        "nodes_dir": str(tmp / "nodes"),
        "schedule": plan,
        "failures_file": str(tmp / "failures.jsonl"),
    }
    w = dataclasses.replace(w, measured_steps=steps - w.warmup_steps)  # elastictrain's LR schedule
    peer = run_peer("ray_train", 3, w, tmp, spec_extra=spec, timeout_s=limit_s)
    ended = time.time()
    lines, done = peer.steps, peer.step_records()
    error = (peer.driver_out or {}).get("error") or (
        None if peer.returncode == 0 else f"exit {peer.returncode}"
    )
    if not done:
        return {"steps": steps, "timeline": [], "seconds": None, "failures": [], "error": error}
    t0 = done[0]["time"]
    failures = [{**f, "time": f["time"] - t0} for f in _read_lines(tmp / "failures.jsonl")]
    timeline = [(r["time"] - t0, r["step"], r["world_size"]) for r in done]
    if timeline[-1][1] < steps:  # stopped at the time limit: the wall time runs to where it stopped
        timeline.append((ended - t0, timeline[-1][1], 0))
    return {
        "steps": steps,
        "timeline": timeline,
        "seconds": done[-1]["time"] - t0,
        "failures": failures,
        "restarts": sum(1 for r in lines if r.get("event") == "attempt_start") - 1,
        "error": error,
    }


def _step_s(calibration: dict[str, Any]) -> float:
    """Wall seconds per step of a run without failures: first completed step to last, over the steps."""
    line = calibration["timeline"]
    return (line[-1][0] - line[0][0]) / max(1, line[-1][1] - line[0][1])


def fault_free_step_s(run: dict[str, Any]) -> float | None:
    """Seconds per step at the full world size, from the run itself: the mean interval between
    consecutive steps of one attempt at the largest world size (disk checkpoints and snapshots
    included, restarts and steps at a smaller size not): what the same run costs without failures."""
    line = run["timeline"]
    full = max((ws for _, _, ws in line), default=0)
    gaps = [
        b[0] - a[0]
        for a, b in zip(line, line[1:], strict=False)
        if b[1] == a[1] + 1 and a[2] == b[2] == full and a[0] > 0
    ]
    return sum(gaps) / len(gaps) if gaps else None


def _goodput(run: dict[str, Any], step_s: float | None) -> float | None:
    line = run["timeline"]
    if not step_s or len(line) < 2 or line[-1][0] <= 0:
        return None
    return (line[-1][1] - line[0][1]) * step_s / (line[-1][0] - line[0][0])


def run(w: Workload, tmp: Path, reps: int, smoke: bool) -> Result:
    minutes = float(os.environ.get("GOODPUT_MINUTES", "1" if smoke else "15"))
    cluster = _cluster()
    try:
        calibration = _run(w, tmp / "calibrate", CALIBRATION_STEPS, [], cluster)
        # The calibration's steady steps (its first ones include the snapshot schedule's start), plus a
        # tenth: the run should last at least `minutes` without failures.
        step_s = fault_free_step_s(calibration) or _step_s(calibration)
        steps = max(EVERY, int(1.1 * minutes * 60 / step_s))
        plan = schedule(minutes * 60 * 1.2)  # the run with failures takes a little longer
        faulty = [_run(w, tmp / f"faulty-rep{rep}", steps, plan, cluster) for rep in range(reps)]
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()
    limit = 1.6 * minutes * 60 + 300  # a peer that stalls is measured up to where it got
    runs = []
    for rep in range(reps):
        peer = _ray_train(w, tmp / f"ray-train-faulty-rep{rep}", steps, plan, limit)
        runs.append({"rep": rep, "with_failures": faulty[rep], "ray_train": peer})
        print(f"  goodput rep {rep}: elastictrain {faulty[rep]['seconds']:.0f}s, Ray Train "
              f"{peer['seconds']}s for {steps} steps", flush=True)  # fmt: skip
    return summarize(w, runs, minutes, steps, step_s, plan, smoke, reps)


def summarize(
    w: Workload,
    runs: list[dict[str, Any]],
    minutes: float,
    steps: int,
    step_s: float,
    plan: list[tuple[float, str]],
    smoke: bool,
    reps: int,
) -> Result:
    """The figures and targets of the runs (each elastictrain's and Ray Train's under the same schedule)."""
    et = [_goodput(r["with_failures"], fault_free_step_s(r["with_failures"])) for r in runs]
    rt = [_goodput(r["ray_train"], fault_free_step_s(r["ray_train"])) for r in runs]
    peer_step_s = fault_free_step_s(runs[-1]["ray_train"])
    recovered = [e for r in runs for e in r["with_failures"]["recovered"]]
    lost = [e["steps_lost"] for e in recovered if e["steps_lost"] is not None and e.get("cause") != "grow"]
    grows = [e for e in recovered if e.get("cause") == "grow"]
    grow_stalls = [e["stall_s"] for e in grows if e.get("stall_s") is not None]
    metrics = {
        "goodput": sorted(et)[len(et) // 2] if None not in et else None,
        "ray_train_goodput": sorted(rt)[len(rt) // 2] if None not in rt else None,
        # Fault-free seconds per step, from each run's own steps at full size; elastictrain's calibration.
        "step_s": {
            "elastictrain": fault_free_step_s(runs[-1]["with_failures"]),
            "ray_train": peer_step_s,
            "elastictrain_calibration": step_s,
        },
        "minutes": minutes,
        "steps": steps,
        "failures_injected": len(runs[-1]["with_failures"]["failures"]),
        "ray_train_failures_injected": len(runs[-1]["ray_train"]["failures"]),
        "ray_train_steps_done": runs[-1]["ray_train"]["timeline"][-1][1]
        if runs[-1]["ray_train"]["timeline"]
        else 0,
        "recoveries_from_memory": sum(
            e["recovered_from"] == "memory" for r in runs for e in r["with_failures"]["recovered"]
        ),
        "steps_lost_total": sum(lost),
        "steps_lost_max": max(lost, default=0),
        "steps_lost_per_failure": lost,
        "snapshot_interval_changes": [
            (c["step"], "off" if c["off"] else c["interval"])
            for c in runs[-1]["with_failures"].get("snapshot_changes", [])
        ],
        "grow_stall_s": grow_stalls,
        "grow_stall_max_s": max(grow_stalls, default=None),
        "grow_stall_median_s": median(grow_stalls) if grow_stalls else None,
    }
    targets = [
        Target("goodput under about one failure a minute (elastictrain)", metrics["goodput"], 0.95, ">="),
        Target(
            "steps lost per failure, the most (elastictrain)",
            metrics["steps_lost_max"],
            1,
            "<=",
            unit="steps",
            note=f"each failure: {lost}; the snapshot schedule's moves (step, interval): "
            f"{metrics['snapshot_interval_changes']}",
        ),
        Target(
            "survivors stopped by a grow, the longest (elastictrain)",
            metrics["grow_stall_max_s"],
            1.5,
            "<=",
            unit="s",
            note="from the last step before the grow to the first after it, less that step's own compute; "
            f"each grow: {[round(x, 2) for x in grow_stalls]}" + slowest_grow_note(grows),
        ),
        Target(
            "goodput, elastictrain / Ray Train (same failures)",
            (metrics["goodput"] / metrics["ray_train_goodput"])
            if metrics["goodput"] and metrics["ray_train_goodput"]
            else None,
            1.0,
            ">",
        ),
    ]
    notes = [
        "goodput: steps done with failures x the system's fault-free seconds per step (the mean interval "
        "between consecutive steps at the full world size in the same run) / the wall time from the first "
        "step to the last. elastictrain's calibration run (no failures) only sets the number of steps.",
        "recoveries include grows (a node added back is joined as soon as its worker is warm, from memory).",
        "Ray Train runs 3 workers fixed (an elastic one cannot load a ZeRO-3 checkpoint at another world "
        "size); it restarts all workers from its last checkpoint on each failure, and after a node loss "
        "waits for the node to come back. A failure the schedule names that does not apply at that moment "
        "(no live worker process, no node to remove or to add) is skipped, for both systems alike.",
    ]
    info = {**workload_info(w), "every_steps": EVERY, "schedule": plan}
    return Result("goodput", smoke, reps, metrics, targets, runs, notes, info)


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.6))
    last = result["runs"][-1]
    m = result["metrics"]
    for key, label, color in (("with_failures", "elastictrain", "C0"), ("ray_train", "Ray Train", "C2")):
        if key not in last:  # results of an older harness
            continue
        line = last[key]["timeline"]
        ax.plot([t for t, _, _ in line], [s for _, s, _ in line], label=f"{label} with failures", color=color)
        per_step = m.get("step_s", {}).get("elastictrain" if key == "with_failures" else "ray_train")
        if line and per_step:  # the same steps without failures, at the calibrated step time
            ax.plot(
                [0, line[-1][1] * per_step],
                [0, line[-1][1]],
                ls=":",
                color=color,
                label=f"{label} fault-free",
            )
        for f in last[key]["failures"]:
            ax.axvline(f["time"], color="C3", alpha=0.3, lw=1)
            ax.annotate(
                f["kind"].replace("_", " "), (f["time"], 0), rotation=90, fontsize=6, va="bottom", color=color
            )
    ax.set_xlabel("s since the first step")
    ax.set_ylabel("steps done")

    def shown(g: float | None) -> str:
        return "n/a" if g is None else f"{g:.2f}"

    ours, theirs = shown(m["goodput"]), shown(m.get("ray_train_goodput"))
    ax.set_title(f"goodput: elastictrain {ours}, Ray Train {theirs}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
