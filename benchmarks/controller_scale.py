"""Controller scale: what the control loop does per check of its workers, at 64 to 4,096 simulated workers.

The loop checks its workers by gathering a step's replies from every rank (control/failures.py
`gather_results`, over the worker group). Here the group is the fake one (testing/fake_group.py), so the
time measured is the loop's own: reading the replies, reducing the step's results, and on a failure
classifying it (one node query for the whole group; for a hang, every worker's progress and
`stalled_workers`) and deciding what follows (`decide_after_failure`). The workers' side (making the
replies) is done before the clock starts. Three cases: all healthy, one worker dead, one worker hung
(every other rank waiting inside a collective). Detection latency: a thread kills a worker at a
random moment while the loop checks back to back; the latency is from that moment to the check that
reports it.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benchmarks.common import Result, Target, median
from elastictrain.cluster.worker_api import WorkerApi

HANG_TIMEOUT_S = 120.0
STEP = 100


def _rules(n: int) -> Any:
    from elastictrain.core.policy import ScalingRules

    return ScalingRules(
        min_workers=n // 2,
        max_workers=n,
        global_batch_size=n * 4,
        micro_batch_size=4,
        max_failures=3,
        wait_for_capacity_s=60,
    )


def _group(n: int) -> Any:
    """n fake workers on n // 8 nodes, set up for an attempt at world size n."""
    from elastictrain.testing.fake_group import FakeGroup

    group = FakeGroup(n, nodes=max(1, n // 8), warmup_polls=0)
    group.request(n)
    workers = group.start_workers(n, None)
    group.poll_warm()
    specs = [(SimpleNamespace(rank=r, world_size=n, start_step=STEP),) for r in range(n)]
    group.gather(group.call_each(workers, WorkerApi.setup, specs), 1.0)
    return group


def check(group: Any, calls: Any, rules: Any, now: float) -> Any:
    """One check of the loop: gather a step's replies; on a failure, classify it and decide."""
    from elastictrain.control.errors import AttemptFailed
    from elastictrain.control.failures import gather_results
    from elastictrain.core.policy import decide_after_failure

    try:
        results = gather_results(group, calls, STEP, timeout_s=HANG_TIMEOUT_S, phase="step")
    except AttemptFailed as e:
        capacity = len(group.workers) - len(e.failure.worker_ids)
        return decide_after_failure(rules, e.failure, 1, capacity, now)
    values = list(results.values())
    sum(r["loss"] for r in values) / len(values)  # the step's mean loss, as the pipeline reports it
    return None


def time_case(n: int, case: str, iterations: int) -> float:
    rules = _rules(n)
    samples = []
    for _ in range(iterations):
        group = _group(n)
        if case == "dead":
            group.die_at_step(rank=n // 3, step=STEP)
        elif case == "hang":
            group.hang_at_step(rank=n // 3, step=STEP)
        calls = group.call(group.workers, WorkerApi.train_step, STEP)  # the workers' side: not timed
        t0 = time.perf_counter()
        check(group, calls, rules, 1000.0)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _kill_later(group: Any, victim: int, died: list[float]) -> None:
    time.sleep(random.uniform(0.005, 0.03))
    died.append(time.perf_counter())
    group.workers[victim].dead = True


def detection_latency(n: int, trials: int) -> float:
    rules = _rules(n)
    latencies = []
    for t in range(trials):
        group = _group(n)
        died: list[float] = []
        th = threading.Thread(target=_kill_later, args=(group, (t * 7919) % n, died))
        th.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            calls = group.call(group.workers, WorkerApi.train_step, STEP)
            if check(group, calls, rules, time.monotonic()) is not None:
                latencies.append(time.perf_counter() - died[0])
                break
        th.join()
    return median(latencies)


def run(reps: int, smoke: bool) -> Result:
    sizes = (64, 256) if smoke else (64, 256, 1024, 4096)
    iterations = 5 if smoke else 30
    runs = []
    for rep in range(max(reps, 3)):
        for n in sizes:
            row = {"rep": rep, "workers": n}
            for case in ("healthy", "dead", "hang"):
                row[f"{case}_iteration_s"] = time_case(n, case, iterations)
            row["death_detection_latency_s"] = detection_latency(n, 3 if smoke else 10)
            runs.append(row)
    metrics: dict[str, Any] = {}
    for n in sizes:
        rows = [r for r in runs if r["workers"] == n]
        metrics[str(n)] = {
            k: median([r[k] for r in rows])
            for k in (
                "healthy_iteration_s",
                "dead_iteration_s",
                "hang_iteration_s",
                "death_detection_latency_s",
            )
        }
    largest = str(max(sizes))
    worst = max(metrics[largest][k] for k in ("healthy_iteration_s", "dead_iteration_s", "hang_iteration_s"))
    targets = [
        Target(f"controller iteration at {largest} workers (worst case)", worst, 0.010, "<=", unit="s")
    ]
    notes = [
        "A check is what the loop does per step with every rank's reply in hand (fake worker group, "
        "testing/fake_group.py): gather, reduce, and on a failure classify (one node query; for a hang every "
        "worker's progress and stalled_workers) and decide. Waiting for Ray's replies and writing run.json "
        "are not in it: on a real cluster the loop waits on step results and learns of a death from Ray "
        "(see the recovery benchmark's detection time).",
    ]
    if smoke:
        notes.append("smoke: 64 and 256 workers only.")
    return Result(
        "controller_scale",
        smoke,
        max(reps, 3),
        metrics,
        targets,
        runs,
        notes,
        {"hang_timeout_s": HANG_TIMEOUT_S},
    )


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = result["metrics"]
    sizes = sorted(int(k) for k in m)
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for key, label in (
        ("healthy_iteration_s", "iteration, healthy"),
        ("dead_iteration_s", "iteration, one dead"),
        ("hang_iteration_s", "iteration, one hung"),
        ("death_detection_latency_s", "death detection latency"),
    ):
        ax.plot(sizes, [m[str(s)][key] * 1000 for s in sizes], marker="o", label=label)
    ax.axhline(10, color="red", ls="--", label="10 ms target")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("simulated workers")
    ax.set_ylabel("ms (median)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
