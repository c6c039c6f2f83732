"""Writes snapshot_costs_tiny_cpu.json: what each in-memory snapshot cost, and each step took, in a real run.

The tiny preset at default settings (a snapshot every step, the 3% rule on), 3 workers on a local Ray
cluster on this machine's CPUs, 300 steps; read back from the run's MLflow metrics `snapshot_cost_s` (the
busiest worker's CPU seconds for the snapshot beside that step) and `step_time_s`. The unit test of the
snapshot schedule resamples them. Run from the repository root:

    python tests/unit/data/measure_snapshot_costs.py
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
STEPS = 300
OVERRIDES = [
    f"training.max_steps={STEPS}",
    "scaling.min_workers=3",
    "scaling.max_workers=3",
    "ray.num_cpus=3",
    "checkpoint.every_steps=100",
    "checkpoint.memory_max_step_share=0",  # every step: measure each one (the schedule under test decides)
    "tracking.plots=false",
    "tracking.system_metrics=false",
]


def main() -> None:
    from elastictrain.rundir.run_dir import RunDir
    from elastictrain.tracking.artifacts import mlflow_run

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "elastictrain", "train", "-c", str(REPO / "conf" / "tiny-cpu.yaml"),
               f"run.dir={run}", *OVERRIDES]  # fmt: skip
        subprocess.run(cmd, check=True, cwd=REPO)
        client, run_id = mlflow_run(RunDir(run), None)
        found = {}
        for key in ("snapshot_cost_s", "step_time_s"):
            by_step = {int(m.step): float(m.value) for m in client.get_metric_history(run_id, key)}
            found[key] = [round(by_step[s], 6) for s in sorted(by_step) if s > 1]  # not the first step
    out = {
        "made_by": "python tests/unit/data/measure_snapshot_costs.py",
        "run": "conf/tiny-cpu.yaml, " + " ".join(OVERRIDES),
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
        **found,
    }
    (HERE / "snapshot_costs_tiny_cpu.json").write_text(json.dumps(out, indent=1) + "\n")
    print({k: len(v) for k, v in found.items()})


if __name__ == "__main__":
    main()
