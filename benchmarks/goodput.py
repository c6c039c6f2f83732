"""Goodput under failures: fault-free time to the final step / wall time with failures injected.

One elastictrain run on a 3-node `ray.cluster_utils.Cluster` (1 CPU each; 3 workers, min 1) with
failures on a fixed seeded schedule of about one a minute, cycling through: a worker killed, a node
removed, the node added back. The same config without failures gives the fault-free time. Both are
timed from their first completed step to their last (cold starts excluded alike). Disk checkpoints
every `EVERY` steps, in-memory snapshots every step (the default).

The duration is `GOODPUT_MINUTES` (environment; default 15 for a full run, 1 for --smoke): the number
of steps is set from the fault-free step time measured in a short calibration run.

Not measured here: Ray Train on the same schedule (see the notes in the result).
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    Result,
    Target,
    Workload,
    config_overrides,
    load,
    run_elastictrain,
    workload_info,
)

EVERY = 20  # disk checkpoint interval (steps): recovery comes from memory, the disk is the fallback
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
    recovered = [e for e in events if e["event"] == "recovered"]
    return {
        "steps": steps,
        "timeline": [(t - times[0][0], s, ws) for t, s, ws in times],
        "seconds": times[-1][0] - times[0][0],
        "failures": [{**f, "time": f["time"] - times[0][0]} for f in done],
        "recovered": [
            {k: e.get(k) for k in ("step", "recovered_from", "steps_lost", "recovery_seconds")}
            for e in recovered
        ],
    }


def run(w: Workload, tmp: Path, reps: int, smoke: bool) -> Result:
    minutes = float(os.environ.get("GOODPUT_MINUTES", "1" if smoke else "15"))
    cluster = _cluster()
    try:
        calibration = _run(w, tmp / "calibrate", 12 if not smoke else 6, [], cluster)
        step_s = calibration["seconds"] / max(1, calibration["steps"] - 1)
        steps = max(EVERY, int(minutes * 60 / step_s))
        plan = schedule(minutes * 60 * 1.1)  # the run with failures takes a little longer
        runs = []
        for rep in range(reps):
            free = _run(w, tmp / f"free-rep{rep}", steps, [], cluster)
            faulty = _run(w, tmp / f"faulty-rep{rep}", steps, plan, cluster)
            runs.append({"rep": rep, "fault_free": free, "with_failures": faulty})
            print(f"  goodput rep {rep}: {free['seconds']:.0f}s fault-free, {faulty['seconds']:.0f}s with "
                  f"{len(faulty['failures'])} failures", flush=True)  # fmt: skip
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()
    goodputs = [r["fault_free"]["seconds"] / r["with_failures"]["seconds"] for r in runs]
    lost = [
        e["steps_lost"] for r in runs for e in r["with_failures"]["recovered"] if e["steps_lost"] is not None
    ]
    metrics = {
        "goodput": sorted(goodputs)[len(goodputs) // 2],
        "minutes": minutes,
        "steps": steps,
        "failures_injected": len(runs[-1]["with_failures"]["failures"]),
        "recoveries_from_memory": sum(
            e["recovered_from"] == "memory" for r in runs for e in r["with_failures"]["recovered"]
        ),
        "steps_lost_total": sum(lost),
        "steps_lost_max": max(lost, default=0),
    }
    targets = [
        Target("goodput under about one failure a minute (elastictrain)", metrics["goodput"], 0.90, ">=")
    ]
    notes = [
        "goodput: fault-free seconds from the first to the last step / the same with failures injected.",
        "recoveries include grows (a node added back is joined at the next disk checkpoint).",
        "Ray Train on the same schedule is not measured: its harness kills one rank once, and it cannot "
        "resume a ZeRO-3 checkpoint at another world size after a node loss (see recovery.json).",
    ]
    info = {**workload_info(w), "every_steps": EVERY, "schedule": plan}
    return Result("goodput", smoke, reps, metrics, targets, runs, notes, info)


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.6))
    last = result["runs"][-1]
    for key, label, color in (("fault_free", "fault-free", "C7"), ("with_failures", "with failures", "C0")):
        line = last[key]["timeline"]
        ax.plot([t for t, _, _ in line], [s for _, s, _ in line], label=f"elastictrain {label}", color=color)
    for f in last["with_failures"]["failures"]:
        ax.axvline(f["time"], color="C3", alpha=0.4, lw=1)
        ax.annotate(f["kind"].replace("_", " "), (f["time"], 0), rotation=90, fontsize=6, va="bottom")
    ax.set_xlabel("s since the first step")
    ax.set_ylabel("steps done")
    ax.set_title(f"goodput {result['metrics']['goodput']:.2f}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
