"""Build DeepSpeed's JIT-compiled ops once (they are cached in ~/.cache/torch_extensions).

A first NVMe-offload run otherwise spends minutes compiling inside the first training step; doing it
at install time keeps that cost out of runs, tests and benchmarks.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

OPS = ("CPUAdamBuilder", "AsyncIOBuilder", "ShareMemCommBuilder")


def prefer_environment_tools() -> None:
    """Put this interpreter's bin folder first on PATH, once per process.

    DeepSpeed's ops are compiled and checked with the `ninja` found on PATH. The environment's ninja
    (a dependency of DeepSpeed) and a system one differ in version, and each takes the other's build
    log for a stale build: a process started without the environment on PATH rebuilt every op
    (minutes each) while every rank waited on the build lock, and the next one rebuilt them back.
    """
    bin_dir = str(Path(sys.executable).parent)
    parts = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p]
    if not parts or parts[0] != bin_dir:
        os.environ["PATH"] = os.pathsep.join([bin_dir, *(p for p in parts if p != bin_dir)])


def build_ops(use_gpu: bool = False) -> dict[str, str]:
    prefer_environment_tools()
    if not use_gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    report: dict[str, str] = {}
    for name in OPS:
        t0 = time.perf_counter()
        try:
            builder = accelerator.create_op_builder(name)
            if builder is None or not builder.is_compatible(verbose=False):
                report[name] = "not available here"
                continue
            builder.load(verbose=False)
            report[name] = f"ready ({time.perf_counter() - t0:.0f}s)"
        except Exception as e:  # noqa: BLE001 - report and continue; the op is optional
            report[name] = f"failed: {e}"
    return report
