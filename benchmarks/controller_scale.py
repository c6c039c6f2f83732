"""Controller scale: decision time per control-loop iteration and failure detection with many workers.

Pure code only (elastictrain.core), on simulated observations of 64 to 4,096 workers. One iteration
is what the controller does per look at its workers: build the snapshot of observations, run
`detect_failure`, and on a failure decide (`decide_after_failure`) and, for a hang, name the culprit
(`stalled_workers`). Three cases: all healthy, one worker dead, one worker hung (every other rank
waiting inside a collective). Detection latency: a thread marks a worker dead at a random moment
while a loop iterates back to back; the latency is from that moment to the iteration that reports it.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Result, Target, median

HANG_TIMEOUT_S = 120.0


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


def iteration(state: dict[str, list[Any]], n: int, now: float, rules: Any) -> Any:
    from elastictrain.core.membership import WorkerObservation, detect_failure, stalled_workers
    from elastictrain.core.policy import decide_after_failure

    obs = [
        WorkerObservation(
            worker_id=state["ids"][i],
            answering=state["answering"][i],
            node_alive=True,
            last_progress=state["progress"][i],
            step=100,
            in_collective=state["in_collective"][i],
        )
        for i in range(n)
    ]
    failure = detect_failure(obs, now, HANG_TIMEOUT_S, 100)
    if failure is None:
        return None
    if failure.kind == "hang":
        stalled_workers(obs)
    alive = sum(state["answering"])
    return decide_after_failure(rules, failure, 1, alive, now)


def _state(n: int, now: float) -> dict[str, list[Any]]:
    return {
        "ids": [f"w{i:05d}" for i in range(n)],
        "answering": [True] * n,
        "progress": [now] * n,
        "in_collective": [False] * n,
    }


def time_case(n: int, case: str, iterations: int) -> float:
    now = 1000.0
    st = _state(n, now)
    rules = _rules(n)
    if case == "dead":
        st["answering"][n // 3] = False
    elif case == "hang":
        st["in_collective"] = [True] * n
        st["in_collective"][n // 3] = False
        now += HANG_TIMEOUT_S + 1
    samples = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        iteration(st, n, now, rules)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _kill_later(state: dict[str, list[Any]], victim: int, died: list[float]) -> None:
    time.sleep(random.uniform(0.005, 0.03))
    died.append(time.perf_counter())
    state["answering"][victim] = False


def detection_latency(n: int, trials: int) -> float:
    rules = _rules(n)
    latencies = []
    for t in range(trials):
        st = _state(n, time.monotonic())
        died: list[float] = []

        th = threading.Thread(target=_kill_later, args=(st, (t * 7919) % n, died))
        th.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            now = time.monotonic()
            for i in range(n):  # the observations arrive: healthy workers report progress
                if st["answering"][i]:
                    st["progress"][i] = now
            if iteration(st, n, now, rules) is not None:
                latencies.append(time.perf_counter() - died[0])
                break
        th.join()
    return median(latencies)


def run(reps: int, smoke: bool) -> Result:
    sizes = (64, 256) if smoke else (64, 256, 1024, 4096)
    iterations = 20 if smoke else 200
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
        "Decision time covers the pure core only; gathering observations from Ray (actor calls) is not "
        "simulated here: on a real cluster the controller waits on step results and learns of a death "
        "from Ray (see the recovery benchmark's detection time).",
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
