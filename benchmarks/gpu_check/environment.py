"""Part a: the machine as the check found it: GPU, driver, torch, CUDA, NCCL, DeepSpeed's op report."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ANSI = re.compile(r"\x1b\[[0-9;]*m")
OP_LINE = re.compile(r"^(\w+) \.*\s*\[(\w+)\]\s*\.*\s*\[(\w+)\]")


BUILD_ENV = ("TORCH_CUDA_ARCH_LIST", "CUDA_HOME", "TORCH_EXTENSIONS_DIR", "MAX_JOBS", "NCCL_SOCKET_IFNAME")


def op_report(text: str) -> dict[str, dict[str, bool]]:
    """DeepSpeed's `ds_report` op table as {op: {installed, compatible}}."""
    ops: dict[str, dict[str, bool]] = {}
    for line in ANSI.sub("", text).splitlines():
        m = OP_LINE.match(line.strip())
        if m:
            ops[m.group(1)] = {"installed": m.group(2) == "YES", "compatible": m.group(3) == "OKAY"}
    return ops


def _version(dist: str) -> str | None:
    """The installed version of an importable package (None where it cannot be imported here)."""
    try:
        if importlib.util.find_spec(dist) is None:
            return None
        return importlib.metadata.version(dist)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None


def _nvidia_smi() -> str | None:
    query = "name,driver_version,memory.total,power.limit,clocks.max.sm,pci.bus_id"
    try:
        done = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unavailable: {e}"
    return done.stdout.strip() or done.stderr.strip()


def run(ctx: Any) -> None:
    import torch

    ctx.record(
        "python",
        {"version": platform.python_version(), "executable": sys.executable, "platform": platform.platform()},
    )
    versions = {d: _version(d) for d in ("torch", "deepspeed", "ray", "transformers", "peft", "omegaconf")}
    versions["mlflow"] = _version("mlflow") or "absent: runs use --no-tracking"
    ctx.record("versions", versions)
    cuda: dict[str, Any] = {"available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda}
    if torch.cuda.is_available():
        nccl = torch.cuda.nccl.version()
        cuda["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        cuda["cudnn"] = torch.backends.cudnn.version()
        cuda["devices"] = [
            {
                "name": torch.cuda.get_device_name(i),
                "capability": ".".join(map(str, torch.cuda.get_device_capability(i))),
                "memory_bytes": torch.cuda.get_device_properties(i).total_memory,
                "multiprocessors": torch.cuda.get_device_properties(i).multi_processor_count,
            }
            for i in range(torch.cuda.device_count())
        ]
        cuda["bf16_supported"] = torch.cuda.is_bf16_supported()
        cuda["nvidia_smi"] = _nvidia_smi()
    ctx.record("cuda", cuda)
    if ctx.profile.use_gpu and not torch.cuda.is_available():
        raise RuntimeError("the GPU profile found no CUDA device (torch.cuda.is_available() is False)")
    ctx.record(
        "libaio",
        {
            "header": Path("/usr/include/libaio.h").exists() or bool(os.environ.get("CPATH")),
            "CPATH": os.environ.get("CPATH"),
        },
    )
    env = {**os.environ}
    done = subprocess.run(
        [sys.executable, "-m", "deepspeed.env_report"], capture_output=True, text=True, timeout=120, env=env
    )
    text = ANSI.sub("", done.stdout + done.stderr)
    ctx.record("deepspeed_ops", op_report(text))
    ctx.record("deepspeed_report", text.splitlines()[-12:])
    ctx.record("cpus", os.cpu_count())
    # What the image sets for builds: DeepSpeed's op builders read TORCH_CUDA_ARCH_LIST.
    ctx.record("build_env", {k: os.environ.get(k) for k in BUILD_ENV})
