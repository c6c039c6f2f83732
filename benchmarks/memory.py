"""Peak memory per rank with no offload, CPU offload and NVMe offload (elastictrain, world size 2).

Peak resident memory (VmHWM) of each worker actor's process, read from /proc at the end of its run,
against the model state a ZeRO-3 rank must hold: 16 bytes per parameter (fp32 weights, two Adam
moments, gradients and the low-precision copy of mixed precision) divided by the world size. On a
tiny model the process's own footprint (Python, torch, DeepSpeed, Ray) dominates; the deepspeed
launcher's ranks on the same workload give that floor, measured in the same run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import baselines
from benchmarks.common import Result, Workload, median, ratio, workload_info

WORLD_SIZE = 2


def run(w: Workload, tmp: Path, reps: int, smoke: bool) -> Result:
    modes = ("none",) if smoke else ("none", "cpu", "nvme")
    runs: list[dict[str, Any]] = []
    params = None
    for rep in range(reps):
        ds = baselines.peer("deepspeed", WORLD_SIZE, w, tmp, rep)
        params = (ds.out or {}).get("parameters") or params
        ds_peak = max(m["peak_rss_bytes"] for m in (ds.out or {})["memory"])
        ds_start = max(m["start_rss_bytes"] for m in (ds.out or {})["memory"])
        runs.append(
            {
                "rep": rep,
                "system": "deepspeed",
                "offload": "none",
                "peak_rss_bytes": ds_peak,
                "after_imports_rss_bytes": ds_start,
            }
        )
        for mode in modes:
            extra: tuple[str, ...] = ()
            if mode != "none":
                (tmp / f"nvme-rep{rep}").mkdir(parents=True, exist_ok=True)  # the config requires it
                extra = (
                    f"deepspeed.offload_optimizer={mode}",
                    f"deepspeed.offload_param={mode}",
                    f"deepspeed.nvme_path={tmp / f'nvme-rep{rep}'}",
                )
            et = baselines.elastictrain(WORLD_SIZE, w, tmp, rep, *extra)
            peak = max(m["peak_rss_bytes"] for m in et["memory"]) if et["memory"] else None
            runs.append({"rep": rep, "system": "elastictrain", "offload": mode, "peak_rss_bytes": peak})
            print(
                f"  memory rep {rep} offload {mode}: peak {peak / 2**20 if peak else float('nan'):.0f} MiB",
                flush=True,
            )
    model_state = 16 * (params or 0) / WORLD_SIZE
    metrics: dict[str, Any] = {
        "parameters": params,
        "world_size": WORLD_SIZE,
        "model_state_bytes_per_rank": model_state,
        "deepspeed_peak_rss_bytes": median([r["peak_rss_bytes"] for r in runs if r["system"] == "deepspeed"]),
        "deepspeed_after_imports_rss_bytes": median(
            [r["after_imports_rss_bytes"] for r in runs if r["system"] == "deepspeed"]
        ),
    }
    for mode in modes:
        peak = median(
            [r["peak_rss_bytes"] for r in runs if r["system"] == "elastictrain" and r["offload"] == mode]
        )
        metrics[f"elastictrain_{mode}_peak_rss_bytes"] = peak
        metrics[f"elastictrain_{mode}_vs_deepspeed"] = ratio(peak, metrics["deepspeed_peak_rss_bytes"])
        metrics[f"elastictrain_{mode}_over_model_state"] = ratio(peak, model_state)
    notes = [
        "No target in the issue: reported against the model-state bound and the deepspeed launcher's ranks."
    ]
    if smoke:
        notes.append("smoke: no offload only (the offload runs differ only by their config).")
    return Result("memory", smoke, reps, metrics, [], runs, notes, workload_info(w))


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = result["metrics"]
    labels, vals = ["deepspeed\nlauncher"], [m["deepspeed_peak_rss_bytes"]]
    for mode in ("none", "cpu", "nvme"):
        if f"elastictrain_{mode}_peak_rss_bytes" in m:
            labels.append(f"elastictrain\noffload {mode}")
            vals.append(m[f"elastictrain_{mode}_peak_rss_bytes"])
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar(labels, [(v or 0) / 2**20 for v in vals])
    ax.axhline(m["model_state_bytes_per_rank"] / 2**20, color="red", ls="--", label="16 B/param / world size")
    ax.set_ylabel("peak RSS per rank (MiB)")
    ax.legend(fontsize=8)
    ax.set_title("Memory per rank, world size 2")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
