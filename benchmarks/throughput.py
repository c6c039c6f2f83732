"""Steady-state throughput (samples/s) at world sizes 2 and 3: elastictrain against its peers.

Every system runs the same steps; the first `warmup_steps` are skipped by all alike. A step's time is
the wall clock between two consecutive completed steps as the system itself sees them (rank 0 for
the peers, the controller for elastictrain), so the driver's overhead counts for elastictrain.
Repetitions interleave the systems, so drift on a shared machine hits them alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import baselines
from benchmarks.common import Result, Target, Workload, median, ratio, workload_info

PEERS = ("deepspeed", "torchrun", "ray_train")


def step_times(records: list[dict[str, Any]]) -> list[float]:
    """Seconds between consecutive completed steps (the first step has no predecessor: dropped)."""
    times = [r["time"] for r in records if "event" not in r]
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def samples_per_s(records: list[dict[str, Any]], w: Workload, global_batch: int) -> float:
    measured = step_times(records)[max(0, w.warmup_steps - 1) :]
    m = median(measured)
    return global_batch / m if m and m == m else float("nan")


def run(w: Workload, tmp: Path, reps: int, smoke: bool) -> Result:
    info = workload_info(w)
    gbs = info["global_batch_size"]
    sizes = (2,) if smoke else (2, 3)
    systems = ("elastictrain", "deepspeed") if smoke else ("elastictrain", *PEERS)
    runs: list[dict[str, Any]] = []
    for rep in range(reps):
        for ws in sizes:
            for system in systems:
                if system == "elastictrain":
                    r = baselines.elastictrain(ws, w, tmp, rep)
                    sps, setup = samples_per_s(r["steps"], w, gbs), r["setup_s"]
                else:
                    p = baselines.peer(system, ws, w, tmp, rep)
                    sps, setup = samples_per_s(p.steps, w, gbs), (p.out or {}).get("setup_s")
                runs.append(
                    {"rep": rep, "world_size": ws, "system": system, "samples_per_s": sps, "setup_s": setup}
                )
                print(f"  throughput rep {rep} ws {ws} {system}: {sps:.2f} samples/s", flush=True)

    metrics: dict[str, Any] = {}
    targets: list[Target] = []
    for ws in sizes:
        per = {
            s: median([r["samples_per_s"] for r in runs if r["system"] == s and r["world_size"] == ws])
            for s in systems
        }
        metrics[f"ws{ws}"] = {"samples_per_s": per}

        # Ratios per repetition (same rep = same machine state), then their median.
        def rep_ratio(a: str, b: str, ws: int = ws) -> float | None:
            vals = []
            for rep in range(reps):
                x = [
                    r["samples_per_s"]
                    for r in runs
                    if r["rep"] == rep and r["world_size"] == ws and r["system"] == a
                ]
                y = [
                    r["samples_per_s"]
                    for r in runs
                    if r["rep"] == rep and r["world_size"] == ws and r["system"] == b
                ]
                if x and y and (q := ratio(x[0], y[0])) is not None:
                    vals.append(q)
            return median(vals) if vals else None

        vs_ds = rep_ratio("elastictrain", "deepspeed")
        metrics[f"ws{ws}"]["elastictrain_vs_deepspeed"] = vs_ds
        targets.append(Target(f"throughput ws{ws}: elastictrain / deepspeed launcher", vs_ds, 0.97, ">="))
        if "ray_train" in systems:
            vs_ray = rep_ratio("elastictrain", "ray_train")
            metrics[f"ws{ws}"]["elastictrain_vs_ray_train"] = vs_ray
            metrics[f"ws{ws}"]["torchrun_vs_deepspeed"] = rep_ratio("torchrun", "deepspeed")
            targets.append(Target(f"throughput ws{ws}: elastictrain / Ray Train", vs_ray, 1.0, ">="))
    notes = [
        "samples/s = global batch / median wall time between consecutive completed steps, warm-up skipped.",
        "One thread per rank for every system (OMP_NUM_THREADS=1; elastictrain's and Ray Train's "
        "one-CPU actors get the same).",
    ]
    if smoke:
        notes.append("smoke: world size 2, elastictrain and the deepspeed launcher only.")
    return Result("throughput", smoke, reps, metrics, targets, runs, notes, info)


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    sizes = sorted(result["metrics"])
    systems = list(next(iter(result["metrics"].values()))["samples_per_s"])
    width = 0.8 / len(systems)
    for i, s in enumerate(systems):
        vals = [result["metrics"][k]["samples_per_s"][s] or 0 for k in sizes]
        ax.bar([j + i * width for j in range(len(sizes))], vals, width, label=s)
    ax.set_xticks(
        [j + 0.4 - width / 2 for j in range(len(sizes))], [k.replace("ws", "world size ") for k in sizes]
    )
    ax.set_ylabel("samples/s (median)")
    ax.set_title("Steady-state throughput, same model/data/DeepSpeed config")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
