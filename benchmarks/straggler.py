"""A rank slowed about 2x in a 3-worker run: how soon it is named, and what replacing it wins back.

Per repetition, three runs of the same workload at 3 workers (`scaling.min_workers: 2`, ZeRO-1, fp32 on
CPU with gloo), one driver: fault-free; rank 1 slowed from step 3 on and kept (`failure.replace_stragglers`
off); the same slowed rank replaced (on). The slowing is a sleep before each of that rank's forward passes
(FaultyTrainWorker.inject_forward_delay) of the fault-free run's median step time over its micro-batches
per rank, so each of its steps takes about twice as long. Opt-in: `--only straggler`.

Measured: the steps from the slowing to the `straggler` event; the throughput (samples/s) before the
slowing and over the run's last `TAIL` steps (after the swap and the grow back, where it replaced), for
each run. Target: the replacing run's tail >= 0.9x the fault-free run's.
"""

from __future__ import annotations

import statistics
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
    run_elastictrain,
    workload_info,
)

SLOWED_AT = 3  # steps done when rank 1 is slowed
TAIL = 8  # the last steps, measured after the straggler is named (and replaced)
STEPS = {True: 16, False: 90}  # smoke; full: long enough for the replacement to warm and grow back
WORKERS = ("scaling.min_workers=2", "scaling.max_workers=3", "deepspeed.zero_stage=1")


def _train(cfg: Any, delay_s: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(each step's record, the run's events): the controller's view, with rank 1 slowed at SLOWED_AT."""
    import ray

    from elastictrain.testing.faulty_worker import FaultyTrainWorker

    steps: list[dict[str, Any]] = []

    def hook(controller: Any) -> None:
        def after_step(c: Any, _index: int, results: list[dict[str, Any]]) -> None:
            steps.append({"step": c.step, "time": time.time(), "world_size": c.world_size})
            if c.step == SLOWED_AT and delay_s > 0:
                ray.get(c.active[1].actor.inject_forward_delay.remote(delay_s))

        controller.callbacks.after_step.append(after_step)

    run_dir = run_elastictrain(cfg, hook, worker_class=FaultyTrainWorker)
    return steps, run_dir.read_events()


def _throughput(steps: list[dict[str, Any]], first: int, last: int, batch: int) -> float | None:
    """Samples/s over steps first..last (1-based), measured from the last step recorded before `first`.

    A step the controller never reported (the one in flight when a straggler is dropped) is not a gap:
    the span starts at the nearest earlier step recorded, and counts the steps between."""
    done = {s["step"]: s["time"] for s in steps}
    start = max((step for step in done if step < first), default=None)
    if start is None or last not in done or done[last] <= done[start]:
        return None
    return (last - start) * batch / (done[last] - done[start])


def run(w: Workload, tmp: Path, reps: int, smoke: bool) -> Result:
    ensure_local_ray()
    steps_n = STEPS[smoke]
    runs: list[dict[str, Any]] = []
    for rep in range(reps):
        base = [*config_overrides(w, tmp / f"straggler-{rep}", *WORKERS), f"training.max_steps={steps_n}"]
        cfg = load([*base, f"run.dir={tmp / f'free-{rep}'}"])
        free, _ = _train(cfg, 0.0)
        gaps = [b["time"] - a["time"] for a, b in zip(free, free[1:], strict=False)]
        per_rank_micros = cfg.training.global_batch_size // (3 * cfg.training.micro_batch_size)
        delay = statistics.median(gaps) / per_rank_micros  # about one more step's time per step
        batch = cfg.training.global_batch_size
        rep_out: dict[str, Any] = {"rep": rep, "forward_delay_s": delay}
        for name, replace in (("fault_free", None), ("kept", False), ("replaced", True)):
            if name == "fault_free":
                steps, events = free, []
            else:
                extra = [
                    f"run.dir={tmp / f'{name}-{rep}'}",
                    f"failure.replace_stragglers={str(replace).lower()}",
                    # One machine is one node: avoiding the straggler's would leave no room to replace it.
                    "failure.straggler_avoid_s=0",
                ]
                steps, events = _train(load([*base, *extra]), delay)
            named = next((e for e in events if e["event"] == "straggler"), None)
            rep_out[name] = {
                "before_samples_per_s": _throughput(steps, 2, SLOWED_AT, batch),
                "tail_samples_per_s": _throughput(steps, steps_n - TAIL + 1, steps_n, batch),
                "named_after_steps": None if named is None else named["step"] - SLOWED_AT,
                "named_ratio": None if named is None else named["ratio"],
                "world_sizes": sorted({s["world_size"] for s in steps[-TAIL:]}),
                # (step, seconds since the first step, world size) as the controller saw them
                "steps": [
                    (s["step"], round(s["time"] - steps[0]["time"], 3), s["world_size"]) for s in steps
                ],
            }
        runs.append(rep_out)
        tails = [rep_out[n]["tail_samples_per_s"] or 0 for n in ("fault_free", "kept", "replaced")]
        print(
            f"  straggler rep {rep}: tail samples/s free {tails[0]:.1f}, kept {tails[1]:.1f}, replaced "
            f"{tails[2]:.1f}; named after {rep_out['replaced']['named_after_steps']} step(s)",
            flush=True,
        )
    metrics: dict[str, Any] = {"steps": steps_n, "slowed_at": SLOWED_AT, "tail_steps": TAIL}
    for name in ("fault_free", "kept", "replaced"):
        for key in ("before_samples_per_s", "tail_samples_per_s", "named_after_steps"):
            values = [r[name][key] for r in runs if r[name][key] is not None]
            metrics[f"{name}_{key}"] = median(values) if values else None
    metrics["replaced_vs_fault_free"] = ratio(
        metrics["replaced_tail_samples_per_s"], metrics["fault_free_tail_samples_per_s"]
    )
    metrics["kept_vs_fault_free"] = ratio(
        metrics["kept_tail_samples_per_s"], metrics["fault_free_tail_samples_per_s"]
    )
    targets = [
        Target(
            "straggler: throughput after replacing the slowed rank / fault-free, last steps",
            metrics["replaced_vs_fault_free"],
            0.9,
            ">=",
            note=f"3 workers, rank 1 slowed about 2x from step {SLOWED_AT}; last {TAIL} of {steps_n} steps",
        )
    ]
    notes = [
        "Three runs per repetition at 3 workers (min_workers 2), ZeRO-1, fp32 on CPU with gloo: fault-free, "
        "rank 1 slowed and kept, rank 1 slowed and replaced (failure.replace_stragglers). The slowing sleeps "
        "before each of rank 1's forward passes for the fault-free median step over its micro-batches.",
        "Replaced: with no warm spare and 2 ranks faster than 3 with it, the straggler is dropped and a new "
        "worker joins by a grow once warm; failure.straggler_avoid_s=0, since one machine is one node.",
        f"failure.straggler_factor 1.3 and straggler_steps 5 (the defaults); tail: the last {TAIL} steps, "
        "after the straggler is named (and, when replaced, the restart from memory and the grow back).",
        "named_after_steps counts from the slowing; steps queued before it ran at the old pace.",
    ]
    if smoke:
        notes.append("smoke: a short run; not a measurement.")
    return Result("straggler", smoke, reps, metrics, targets, runs, notes, workload_info(w))


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = result["metrics"]
    names = ["fault_free", "kept", "replaced"]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    x = range(len(names))
    before = [m[f"{n}_before_samples_per_s"] or 0 for n in names]
    tail = [m[f"{n}_tail_samples_per_s"] or 0 for n in names]
    ax.bar([i - 0.2 for i in x], before, width=0.4, label="before the slowing", color="#8c8c8c")
    ax.bar([i + 0.2 for i in x], tail, width=0.4, label=f"last {m['tail_steps']} steps", color="#4c72b0")
    ax.set_xticks(list(x), ["fault-free", "straggler kept", "straggler replaced"])
    ax.set_ylabel("samples/s (median)")
    ax.set_title("One rank of 3 slowed about 2x")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
