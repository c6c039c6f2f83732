"""A driver's next run on the warm workers its last run left (scaling.keep_warm_s), against new workers.

A sweep, or a notebook calling `fit` again, trains again in the same driver. Per repetition this runs
the workload at world size 2 three times in one driver process: a first run with keep_warm_s on (its
workers parked at its end), a second run that takes them back, and the same run once more on new
workers (the parked ones released first). Measured for the last two: the seconds from the call to the
first step's report (workers, imports, engine, data), the run's wall time, and the CPU seconds the whole
machine spent during it (/proc/stat: the driver, Ray's processes and every worker).
Target: the warm run reaches its first step in at most half the time new workers take.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from benchmarks.baselines import ensure_local_ray
from benchmarks.common import (
    Result,
    Target,
    Workload,
    config_overrides,
    load,
    median,
    ratio,
    record_steps,
    run_elastictrain,
    workload_info,
)

WORLD_SIZE = 2
KEEP_S = 120  # long enough for the next run of the repetition to start


def _machine_cpu_s() -> float:
    """CPU seconds this machine spent (user, nice, system, irq, softirq) since boot."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(fields[i] for i in (0, 1, 2, 5, 6)) / 100


def _run(w: Workload, run_path: Path, keep_s: float) -> dict[str, Any]:
    cfg = load(
        config_overrides(
            w,
            run_path,
            f"scaling.min_workers={WORLD_SIZE}",
            f"scaling.max_workers={WORLD_SIZE}",
            f"checkpoint.every_steps={w.steps}",
            f"scaling.keep_warm_s={keep_s}",
        )
    )
    steps: list[dict[str, Any]] = []
    pids: list[int] = []

    def remember_pids(controller: Any, _index: int, _results: list[dict[str, Any]]) -> None:
        if not pids:  # the workers of the first step
            pids.extend(int(h.info["pid"]) for h in controller.active)

    def hook(controller: Any) -> None:
        record_steps(steps)(controller)
        controller.callbacks.after_step.append(remember_pids)

    cpu0, t0 = _machine_cpu_s(), time.time()
    run_elastictrain(cfg, hook)
    return {
        "first_step_s": steps[0]["time"] - t0,
        "wall_s": time.time() - t0,
        "machine_cpu_s": _machine_cpu_s() - cpu0,
        "worker_pids": sorted(pids),
    }


def run(w: Workload, tmp: Path, reps: int, smoke: bool) -> Result:
    from elastictrain.cluster import warm_pool

    ensure_local_ray()
    runs: list[dict[str, Any]] = []
    for rep in range(reps):
        warm_pool.release_all()
        first = _run(w, tmp / f"warm-first-rep{rep}", KEEP_S)
        warm = _run(w, tmp / f"warm-second-rep{rep}", KEEP_S)
        warm_pool.release_all()
        new = _run(w, tmp / f"warm-new-rep{rep}", 0)
        if warm["worker_pids"] != first["worker_pids"] or set(new["worker_pids"]) & set(first["worker_pids"]):
            raise RuntimeError(
                f"warm_rerun: the second run's workers {warm['worker_pids']} are not the first run's "
                f"{first['worker_pids']}, or the new run's {new['worker_pids']} are: the comparison is void"
            )
        runs.append({"rep": rep, "first": first, "warm": warm, "new": new})
        print(
            f"  warm_rerun rep {rep}: first step {warm['first_step_s']:.1f}s warm, "
            f"{new['first_step_s']:.1f}s new",
            flush=True,
        )
    metrics: dict[str, Any] = {"world_size": WORLD_SIZE, "keep_warm_s": KEEP_S}
    for kind in ("warm", "new"):
        for key in ("first_step_s", "wall_s", "machine_cpu_s"):
            metrics[f"{kind}_{key}"] = median([r[kind][key] for r in runs])
    share = ratio(metrics["warm_first_step_s"], metrics["new_first_step_s"])
    metrics["warm_vs_new_first_step"] = share
    metrics["cpu_s_saved_per_run"] = metrics["new_machine_cpu_s"] - metrics["warm_machine_cpu_s"]
    targets = [
        Target(
            "warm_rerun: time to the first step on warm workers / on new workers",
            share,
            0.5,
            "<=",
            note=f"world size {WORLD_SIZE}, the same run on the same cluster",
        )
    ]
    notes = [
        f"world size {WORLD_SIZE}, fp32 on CPU with gloo, one driver process; each repetition: a first "
        f"run with scaling.keep_warm_s={KEEP_S}, the warm run taking its workers, then the same run on "
        "new workers (the parked ones released).",
        "first_step_s: from the call to the first step's report; machine_cpu_s: every process of this "
        "machine during the run (/proc/stat), so other load on the machine counts too.",
        "Checked: the warm run's worker processes are the first run's, and the new run's are not.",
    ]
    return Result("warm_rerun", smoke, reps, metrics, targets, runs, notes, workload_info(w))


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = result["metrics"]
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    labels = ["to the first step", "whole run"]
    x = range(len(labels))
    new = [m["new_first_step_s"], m["new_wall_s"]]
    warm = [m["warm_first_step_s"], m["warm_wall_s"]]
    ax.bar([i - 0.2 for i in x], new, width=0.4, label="new workers", color="#c44e52")
    ax.bar([i + 0.2 for i in x], warm, width=0.4, label="warm workers (keep_warm_s)", color="#4c72b0")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("seconds (median)")
    ax.set_title(f"A driver's next run, world size {m['world_size']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
