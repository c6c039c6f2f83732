"""Pictures of a run: loss and validation loss, learning rate, throughput and world size over steps.

Metrics come from the run's MLflow run (every step's, logged once); the world size and the markers from
events.jsonl:
failures (red), recoveries (green) and resizes (blue, with the new world size). Written as PNGs to
RUN_DIR/plots at the end of a run (`tracking.plots`) and by `elastictrain plot RUN_DIR`, and logged
to the MLflow run under `plots/`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastictrain.rundir.run_dir import RunDir

log = logging.getLogger("elastictrain.plots")

PLOTS = "plots"
# A preference objective's figures (TRL's names), drawn where the run logged them.
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "eval_rewards/margins")
METRICS = (
    "loss", "eval_loss", "lr", "samples_per_s", "tokens_per_s", *REWARDS,
    "rewards/accuracies", "eval_rewards/accuracies", "logps/chosen", "logps/rejected", "kl",
)  # fmt: skip
# (file, title, y label, metrics drawn)
FIGURES = (
    ("loss.png", "loss", "loss (per target token; per pair for preferences)", ("loss", "eval_loss")),
    ("rewards.png", "preference rewards", "beta x log-ratio", REWARDS),
    (
        "accuracy.png",
        "preference accuracy",
        "share of pairs chosen > rejected",
        ("rewards/accuracies", "eval_rewards/accuracies"),
    ),  # fmt: skip
    ("logps.png", "answers' log-probabilities", "summed log-probability", ("logps/chosen", "logps/rejected")),
    ("kl.png", "KTO's KL estimate", "mean log-ratio", ("kl",)),
    ("lr.png", "learning rate", "lr", ("lr",)),
    ("throughput.png", "throughput", "samples/s", ("samples_per_s",)),
    ("world_size.png", "world size", "workers", ("world_size",)),
)
COLORS = {"failure": "tab:red", "recovered": "tab:green", "resize": "tab:blue"}


@dataclass(frozen=True)
class Marker:
    step: int
    kind: str  # failure | recovered | resize
    label: str


def markers(events: list[dict[str, Any]]) -> list[Marker]:
    """Failures, recoveries and world-size changes, at the step each happened."""
    out: list[Marker] = []
    size: int | None = None
    for e in events:
        name, step = e.get("event"), int(e.get("step") or 0)
        if name == "failure":
            out.append(Marker(step, "failure", str(e.get("kind", "failure"))))
        elif name == "recovered":
            out.append(Marker(step, "recovered", "recovered"))
        elif name == "attempt_started":
            new = int(e.get("world_size") or 0)
            if size is not None and new != size:
                out.append(Marker(step, "resize", f"{size}->{new}"))
            size = new
    return out


def world_sizes(events: list[dict[str, Any]], last_step: int) -> list[tuple[int, float]]:
    """The world size each attempt trained at, from the step it started at (events, not the per-step
    metric: a step redone after a failure is logged once, with the world size it first ran at)."""
    points = [
        (int(e.get("step") or 0), float(e["world_size"]))
        for e in events
        if e.get("event") == "attempt_started"
    ]
    if points and last_step > points[-1][0]:
        points.append((last_step, points[-1][1]))
    return points


def metric_histories(client: Any, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """Each metric's (step, value) in step order; a step logged twice keeps its last value."""
    found: dict[str, list[tuple[int, float]]] = {}
    for key in METRICS:
        by_step: dict[int, float] = {}
        for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp):
            by_step[int(m.step)] = float(m.value)
        if by_step:
            found[key] = sorted(by_step.items())
    return found


def make_plots(histories: dict[str, list[tuple[int, float]]], marks: list[Marker], out: Path) -> list[Path]:
    """One PNG per figure that has data; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, title, ylabel, keys in FIGURES:
        series = {k: histories[k] for k in keys if histories.get(k)}
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
        for key, points in series.items():
            steps, values = zip(*points, strict=True)
            style = {"drawstyle": "steps-post"} if key == "world_size" else {}
            marker = "o" if key.startswith("eval_") else None
            ax.plot(steps, values, marker=marker, markersize=3, label=key, **style)
        seen: set[str] = set()
        for m in marks:
            ax.axvline(m.step, color=COLORS[m.kind], linestyle="--", linewidth=1, alpha=0.7,
                       label=m.kind if m.kind not in seen else None)  # fmt: skip
            ax.annotate(m.label, (m.step, 1.0), xycoords=("data", "axes fraction"), fontsize=7,
                        color=COLORS[m.kind], rotation=90, va="top", ha="right")  # fmt: skip
            seen.add(m.kind)
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
        fig.tight_layout()
        path = out / name
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def plot_run(run_dir: RunDir, configured_uri: str | None, *, log: bool = True) -> list[Path]:
    """Write RUN_DIR/plots/*.png from the run's MLflow metrics and events; log them to its MLflow run."""
    from elastictrain.tracking.artifacts import log_files, mlflow_run

    client, run_id = mlflow_run(run_dir, configured_uri)
    histories = metric_histories(client, run_id)
    if not histories:
        raise ValueError(f"{run_dir.path}: its MLflow run {run_id} holds no step metrics yet")
    events = run_dir.read_events()
    histories["world_size"] = world_sizes(events, run_dir.read_info().last_step)
    written = make_plots(histories, markers(events), run_dir.path / PLOTS)
    if log:
        log_files(run_dir, configured_uri, written, PLOTS)
    return written


def plots_at_end(config: Any, run_dir: RunDir, say: Any) -> None:
    """The end of a run's driver: its plots, unless `tracking.plots` is off; never fails the run."""
    if not config.tracking.plots:
        return
    try:
        written = plot_run(run_dir, config.tracking.uri)
    except Exception as e:  # noqa: BLE001 - pictures are never a reason to report a run as failed
        log.warning("plots of %s not made: %s", run_dir.path, e)
        say(f"plots not made: {e}; `elastictrain plot {run_dir.path}` makes them later")
        return
    run_dir.append_event("plots", files=[p.name for p in written])
    say(f"plots in {run_dir.path / PLOTS}: {', '.join(p.name for p in written)} (also in the MLflow run)")
