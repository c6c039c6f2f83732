"""Pipeline stages against ZeRO-3 and tensor parallelism at two ranks, and a pipeline replica's loss.

Per model size (the 30M and 125M presets; the tiny preset with --smoke), three runs of the same model,
data, global batch and steps at world size 2, fp32 on CPU with gloo, in-memory snapshots off (what is
compared is the layout): P 2 x D 1 under ZeRO-1 (`scaling.pipeline_parallel=2`), ZeRO-3 x D 2 (the
presets' default), TP 2 x D 1 under ZeRO-1. Measured: the median step time after the warm-up steps (as
the controller sees steps complete) and samples/s. The pipeline's bubble is DeepSpeed's 1F1B schedule's,
(P - 1) / (m + P - 1) of a step for m micro-batches per replica: derived from the plan, not timed
(a stage's idle time is not reported by DeepSpeed's engine).

Then a P 2 x D 2 run (the benchmark workload, four ranks, a snapshot every step) whose second replica's
last stage is killed after step RECOVERY_KILL_AT: the other replica goes on from memory; measured, the
controller's `recovered` figures (seconds from detection to the first step after the restart, the
seconds training stood still, steps lost). No target: which layout wins depends on the model, the
devices and the network (on CPU with gloo every layout's collectives share two cores); the GPU check
part measures it on GPUs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from benchmarks.baselines import ensure_local_ray
from benchmarks.common import (
    ROOT,
    Result,
    Workload,
    config_overrides,
    load,
    median,
    ratio,
    record_steps,
    run_elastictrain,
    workload_info,
)

SIZES = {"30m": ROOT / "conf" / "llama-30m.yaml", "125m": ROOT / "conf" / "llama-125m.yaml"}
SMOKE_SIZES = {"tiny": ROOT / "conf" / "tiny-cpu.yaml"}
LAYOUTS = {
    "pp2_zero1": ("scaling.pipeline_parallel=2", "deepspeed.zero_stage=1"),
    "zero3": ("deepspeed.zero_stage=3",),
    "tp2_zero1": ("scaling.tensor_parallel=2", "deepspeed.zero_stage=1"),
}
WARMUP, MEASURED = 2, {True: 2, False: 5}
RECOVERY_KILL_AT = 5
RECOVERY_STEPS = {True: 8, False: 12}


def _layout_run(preset: Path, layout: str, tmp: Path, smoke: bool) -> dict[str, Any]:
    from elastictrain.config import load_config

    steps_n = WARMUP + MEASURED[smoke]
    run_path = tmp / f"pipeline-{preset.stem}-{layout}"
    cfg = load_config(
        preset,
        [
            f"run.dir={run_path}",
            f"training.max_steps={steps_n}",
            "training.warmup_steps=1",
            "scaling.min_workers=2",
            "scaling.max_workers=2",
            f"checkpoint.every_steps={steps_n}",
            "checkpoint.memory_every_steps=0",
            "tracking.plots=false",
            "tracking.system_metrics=false",
            *LAYOUTS[layout],
        ],
    )
    steps: list[dict[str, Any]] = []
    run_dir = run_elastictrain(cfg, record_steps(steps))
    start = next(e for e in run_dir.read_events() if e["event"] == "attempt_started")
    step_s = median([s["step_s"] for s in steps[WARMUP:]])
    return {
        "preset": preset.stem,
        "layout": layout,
        "step_s": step_s,
        "samples_per_s": cfg.training.global_batch_size / step_s if step_s else None,
        "attempt": start["message"],
        "micro_batches_per_replica": int(start.get("grad_accum_steps") or 0) or _accumulation(cfg, layout),
    }


def _accumulation(cfg: Any, layout: str) -> int:
    from elastictrain.core.batch import plan_batch

    stages = 2 if layout == "pp2_zero1" else 1
    tensor = 2 if layout == "tp2_zero1" else 1
    plan = plan_batch(cfg.training.global_batch_size, cfg.training.micro_batch_size, 2, tensor, stages)
    assert plan is not None
    return plan.grad_accum_steps


def _recovery_run(w: Workload, tmp: Path, smoke: bool) -> dict[str, Any]:
    import ray

    steps_n = RECOVERY_STEPS[smoke]
    cfg = load(
        config_overrides(
            w,
            tmp / "pipeline-recovery",
            "scaling.pipeline_parallel=2",
            "deepspeed.zero_stage=1",
            "scaling.min_workers=2",
            "scaling.max_workers=4",
            f"training.max_steps={steps_n}",
            "checkpoint.every_steps=100",
            "checkpoint.memory_max_step_share=0",
        )
    )
    killed: list[float] = []

    def hook(controller: Any) -> None:
        def after_step(c: Any, _index: int, _results: Any) -> None:
            if c.step == RECOVERY_KILL_AT and not killed and len(c.active) == 4:
                killed.append(time.time())
                ray.kill(c.active[3].actor)

        controller.callbacks.after_step.append(after_step)

    run_dir = run_elastictrain(cfg, hook)
    events = run_dir.read_events()
    recovered = next(e for e in events if e["event"] == "recovered")
    starts = [(e["world_size"], e["source"], e["step"]) for e in events if e["event"] == "attempt_started"]
    return {
        "recovery_seconds": recovered.get("recovery_seconds"),
        "stall_s": recovered.get("stall_s"),
        "steps_lost": recovered.get("steps_lost"),
        "recovered_from": recovered.get("recovered_from"),
        "attempts": starts,
    }


def run(w: Workload, tmp: Path, reps: int, smoke: bool) -> Result:
    ensure_local_ray()
    sizes = SMOKE_SIZES if smoke else SIZES
    runs: list[dict[str, Any]] = []
    for rep in range(reps):
        for preset in sizes.values():
            for layout in LAYOUTS:
                r = {"rep": rep, **_layout_run(preset, layout, tmp / f"rep{rep}", smoke)}
                runs.append(r)
                print(f"  pipeline rep {rep} {preset.stem} {layout}: {r['step_s']:.2f} s/step", flush=True)
        r = {"rep": rep, "recovery": _recovery_run(w, tmp / f"rep{rep}", smoke)}
        runs.append(r)
        print(f"  pipeline rep {rep} P2xD2 recovery: {r['recovery']}", flush=True)

    metrics: dict[str, Any] = {"world_size": 2}
    for name in sizes:
        preset = sizes[name].stem
        per: dict[str, Any] = {}
        for layout in LAYOUTS:
            mine = [r for r in runs if r.get("preset") == preset and r.get("layout") == layout]
            per[layout] = {
                "step_s": median([r["step_s"] for r in mine]),
                "samples_per_s": median(
                    [r["samples_per_s"] for r in mine if r["samples_per_s"]] or [float("nan")]
                ),
            }
        m = next(
            r["micro_batches_per_replica"]
            for r in runs
            if r.get("preset") == preset and r.get("layout") == "pp2_zero1"
        )
        per["pp2_bubble_fraction_1f1b"] = (2 - 1) / (m + 2 - 1)
        per["pp2_micro_batches"] = m
        per["pp2_vs_zero3_samples_per_s"] = ratio(
            per["pp2_zero1"]["samples_per_s"], per["zero3"]["samples_per_s"]
        )
        per["pp2_vs_tp2_samples_per_s"] = ratio(
            per["pp2_zero1"]["samples_per_s"], per["tp2_zero1"]["samples_per_s"]
        )
        metrics[name] = per
    recoveries = [r["recovery"] for r in runs if "recovery" in r]
    metrics["p2xd2_recovery_seconds"] = median(
        [r["recovery_seconds"] for r in recoveries if r["recovery_seconds"]] or [float("nan")]
    )
    metrics["p2xd2_stall_s"] = median(
        [r["stall_s"] for r in recoveries if r["stall_s"] is not None] or [float("nan")]
    )
    metrics["p2xd2_steps_lost"] = max((r["steps_lost"] or 0) for r in recoveries)
    metrics["p2xd2_recovered_from"] = sorted({str(r["recovered_from"]) for r in recoveries})
    notes = [
        "World size 2, fp32 on CPU with gloo, in-memory snapshots off: P 2 x D 1 under ZeRO-1, ZeRO-3 x D 2, "
        "TP 2 x D 1 under ZeRO-1; step_s: median of the steps after the first "
        f"{WARMUP}, as the controller sees them complete.",
        "pp2_bubble_fraction_1f1b: (P - 1) / (m + P - 1) for DeepSpeed's 1F1B schedule with m micro-batches "
        "per replica, derived from the plan (not timed).",
        f"Recovery: P 2 x D 2 (the benchmark workload, 4 ranks, a snapshot every step), the second replica's "
        f"last stage killed after step {RECOVERY_KILL_AT}; the controller's `recovered` event: seconds from "
        "detection to the first step after the restart, seconds training stood still, steps lost.",
        "On CPU every layout's collectives and compute share two cores; what pipelines buy (no parameter "
        "gathers over a slow network, layers beyond one device) shows on GPUs across nodes.",
    ]
    if smoke:
        notes.append("smoke: the tiny preset, a few steps; not a measurement.")
    return Result("pipeline", smoke, reps, metrics, [], runs, notes, workload_info(w))


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [k for k, v in result["metrics"].items() if isinstance(v, dict) and "zero3" in v]
    labels = {"pp2_zero1": "P 2, ZeRO-1", "zero3": "ZeRO-3 x D 2", "tp2_zero1": "TP 2, ZeRO-1"}
    fig, ax = plt.subplots(figsize=(6, 3.2))
    width = 0.25
    for i, layout in enumerate(labels):
        vals = [result["metrics"][s][layout]["samples_per_s"] or 0 for s in sizes]
        ax.bar([j + i * width for j in range(len(sizes))], vals, width, label=labels[layout])
    ax.set_xticks([j + width for j in range(len(sizes))], sizes)
    ax.set_ylabel("samples/s (median)")
    ax.set_title("Two ranks: pipeline stages, ZeRO-3, tensor parallel")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
