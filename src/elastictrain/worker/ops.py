"""Build DeepSpeed's JIT-compiled ops once (they are cached in ~/.cache/torch_extensions).

A first NVMe-offload run otherwise spends minutes compiling inside the first training step; doing it
at install time keeps that cost out of runs, tests and benchmarks.
"""

from __future__ import annotations

import os
import time

OPS = ("CPUAdamBuilder", "AsyncIOBuilder", "ShareMemCommBuilder")


def build_ops(use_gpu: bool = False) -> dict[str, str]:
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
