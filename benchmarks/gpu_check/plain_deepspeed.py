"""The plain DeepSpeed script beside elastictrain: benchmarks/peers/train_step.py under torchrun.

Same config, model build, DeepSpeed config, batches and step as elastictrain's worker; no Ray, no
controller, no snapshots. NCCL and the CUDA accelerator on a GPU, gloo and the CPU one in the dry run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.gpu_check.profile import ROOT, Profile

SCRIPT = ROOT / "benchmarks" / "peers" / "train_step.py"


def run(
    profile: Profile,
    config: Path,
    overrides: list[str],
    steps: int,
    work: Path,
    timeout_s: float,
    **spec: Any,
) -> dict[str, Any]:
    """Run `steps` steps on one rank; returns rank 0's step lines and its summary (`out`)."""
    work.mkdir(parents=True, exist_ok=True)
    full = {
        "config_path": str(config),
        "overrides": overrides,
        "steps": steps,
        "steps_file": str(work / "steps.jsonl"),
        "out": str(work / "out.json"),
        "backend": "nccl" if profile.use_gpu else "gloo",
        **spec,
    }
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(full))
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cuda" if profile.use_gpu else "cpu",
        "OMP_NUM_THREADS": str(profile.cpus_per_worker),  # what elastictrain's actor is given
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "PYTHONUNBUFFERED": "1",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
    cmd += [str(SCRIPT), "--spec", str(spec_path)]
    with open(work / "log.txt", "wb") as log:
        done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
    lines = [json.loads(ln) for ln in Path(full["steps_file"]).read_text().splitlines() if ln.strip()]
    if done.returncode != 0 or not Path(full["out"]).exists():
        tail = (work / "log.txt").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"plain DeepSpeed run exited {done.returncode}; log tail:\n{tail}")
    return {"steps": [r for r in lines if "event" not in r], "out": json.loads(Path(full["out"]).read_text())}
