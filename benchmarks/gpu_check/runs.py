"""elastictrain runs as the check makes them: the product's own entry point (`run_training`), on Ray or
`--local`, with each completed step's loss, time and memory peaks recorded as the controller sees them."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu_check.profile import Profile


def overrides(profile: Profile, run_dir: Path, *extra: str, workers: int = 1) -> list[str]:
    """The dotlist every run of the check is made with: the profile's device, precision and world size."""
    return [
        f"run.dir={run_dir}",
        f"training.precision={profile.precision}",
        *profile.scaling(workers),
        "failure.max_failures=0",  # a failure here is a finding, not something to recover from
        *extra,
    ]


def config(profile: Profile, base: Path, run_dir: Path, *extra: str, workers: int = 1) -> Any:
    from elastictrain.config import load_config

    return load_config(base, overrides(profile, run_dir, *extra, workers=workers))


def train(cfg: Any, *, local: bool = False) -> dict[str, Any]:
    """Train `cfg` to its end; returns every completed step's record, the set-up and the run's events."""
    from elastictrain.control.progress import Reporter
    from elastictrain.core.losses import step_loss
    from elastictrain.driver.launch import prepare_run_dir, run_training

    steps: list[dict[str, Any]] = []
    t0 = time.perf_counter()

    def after_step(controller: Any, index: int, results: list[dict[str, Any]]) -> None:
        # Into the part's log as it happens: a part cut off at its limit still shows where time went.
        print(f"[run] step {index + 1} done at {time.perf_counter() - t0:.1f}s", flush=True)
        steps.append(
            {
                "step": index + 1,
                "time": time.time(),
                "loss": step_loss(results),
                "rank_step_s": max(float(r["step_time_s"]) for r in results),
                "host_peak_bytes": max((r.get("host_peak_bytes") or 0) for r in results),
                "device_peak_bytes": max((r.get("device_peak_bytes") or 0) for r in results),
            }
        )

    def hook(controller: Any) -> None:
        controller.callbacks.after_step.append(after_step)

    run_dir, _ = prepare_run_dir(cfg, fresh=True)
    summary = run_training(
        cfg,
        run_dir,
        tracking=False,
        reporter=Reporter(cfg.training.max_steps, stream=sys.stdout, live=False),
        controller_hook=hook,
        local=local,
    )
    events = run_dir.read_events()
    if summary.status.value != "FINISHED":
        story = [f"{e['event']}: {str(e.get('message') or '')[:300]}" for e in events[-10:]]
        raise RuntimeError(
            f"run {run_dir.path} ended {summary.status.value}: {summary.message}\n" + "\n".join(story)
        )
    return {
        "steps": steps,
        "wall_s": time.perf_counter() - t0,
        "events": events,
        "run_dir": str(run_dir.path),
    }


def measured_intervals(steps: list[dict[str, Any]], first: int, last: int) -> list[float]:
    """Wall seconds each of steps `first`..`last` (1-based) took, read as the time between its completion
    and the previous step's, as the system itself saw them (elastictrain: the controller, its driver's
    overhead counted; the plain script: rank 0)."""
    done = {int(s["step"]): float(s["time"]) for s in steps}
    return [done[k] - done[k - 1] for k in range(max(first, 2), last + 1) if k in done and k - 1 in done]


def median(values: list[float]) -> float | None:
    import statistics

    clean = [v for v in values if v is not None and v == v]
    return statistics.median(clean) if clean else None
