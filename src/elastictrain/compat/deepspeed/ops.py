"""Build DeepSpeed's JIT-compiled ops once, into a cache of this environment's own.

A first NVMe-offload run otherwise spends minutes compiling inside the first training step; doing it
at install time keeps that cost out of runs, tests and benchmarks. The cache lies under
~/.cache/torch_extensions/elastictrain-<key> (one per DeepSpeed install) unless TORCH_EXTENSIONS_DIR
says where.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

OPS = ("CPUAdamBuilder", "AsyncIOBuilder", "ShareMemCommBuilder")


def prefer_environment_tools() -> None:
    """Put this interpreter's bin folder first on PATH, and give DeepSpeed's ops this environment's own
    cache (`own_extensions_dir`, unless TORCH_EXTENSIONS_DIR is set), once per process.

    DeepSpeed's ops are compiled and checked with the `ninja` found on PATH. The environment's ninja
    (a dependency of DeepSpeed) and a system one differ in version, and each takes the other's build
    log for a stale build: a process started without the environment on PATH rebuilt every op
    (minutes each) while every rank waited on the build lock, and the next one rebuilt them back.
    """
    bin_dir = str(Path(sys.executable).parent)
    parts = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p]
    if not parts or parts[0] != bin_dir:
        os.environ["PATH"] = os.pathsep.join([bin_dir, *(p for p in parts if p != bin_dir)])
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(own_extensions_dir()))


def own_extensions_dir() -> Path:
    """Where this environment's DeepSpeed ops are compiled and cached.

    torch's default cache (~/.cache/torch_extensions/py311_cpu) is shared by every environment of the
    user. Two checkouts, each with its own virtual environment, compile the same op from sources at
    their own paths; each takes the other's build for stale, so every alternation rebuilt every op
    (3-4 minutes on 2 cores, every rank waiting on the build lock). One cache per DeepSpeed install
    (its folder, hashed) and Python version ends that; a second install builds once.
    """
    spec = importlib.util.find_spec("deepspeed")  # finds the package without importing it
    where = str(Path(spec.origin).parent) if spec and spec.origin else sys.prefix
    key = hashlib.sha256(where.encode()).hexdigest()[:12]
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    return Path.home() / ".cache" / "torch_extensions" / f"elastictrain-{python}-{key}"


def remember_cpu_info() -> None:
    """Make py-cpuinfo's `get_cpu_info` ask once per machine: at the first call, then from a file.

    Each call starts a Python subprocess that probes the CPU: 1.1 s here. DeepSpeed calls it whenever it
    loads a CPU op (twice, for its compiler flags) and whenever it creates its CPU Adam: a CPU-offload
    engine build spent 3.4 s of 4.3 in it at 30M, an NVMe one 5.7 s of 6.8, on every restart's
    critical path, and every worker's warm-up 2.3 s. The answer is kept for the process, and in a file
    named after the CPU's own description (`cpu_fingerprint`), so another CPU never reads it. Each
    caller gets its own copy.
    """
    import functools

    import cpuinfo

    if getattr(cpuinfo.get_cpu_info, "remembered", False):
        return
    probe = cpuinfo.get_cpu_info
    asked_once = functools.cache(lambda: cpu_info_from_file(probe, Path.home() / ".cache" / "elastictrain"))

    def get_cpu_info() -> dict[str, Any]:
        return dict(asked_once())

    get_cpu_info.remembered = True  # type: ignore[attr-defined]
    cpuinfo.get_cpu_info = get_cpu_info


def cpu_fingerprint() -> str | None:
    """A digest of what /proc/cpuinfo says about the CPU's kind and features (not its clock or load)."""
    import platform

    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    kinds = (
        "vendor_id",
        "cpu family",
        "model",
        "model name",
        "flags",
        "Features",
        "CPU implementer",
        "CPU part",
    )
    lines = sorted({line.strip() for line in text.splitlines() if line.split(":")[0].strip() in kinds})
    return hashlib.sha256("\n".join([platform.machine(), *lines]).encode()).hexdigest()[:16]


def cpu_info_from_file(probe: Any, folder: Path) -> dict[str, Any]:
    """`probe()`'s answer as saved in `folder` for this CPU, probed and saved there when missing."""
    import json

    key = cpu_fingerprint()
    path = folder / f"cpuinfo-{key}.json" if key else None
    if path is not None:
        try:
            return dict(json.loads(path.read_text()))
        except (OSError, ValueError):
            pass  # not saved yet (or unreadable): probe
    info = dict(probe())
    if path is not None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(json.dumps(info))
            partial.replace(path)  # whole or absent, for workers starting together
        except (OSError, TypeError, ValueError):
            pass  # unsaved: the next process probes again
    return info


def import_deepspeed() -> Any:
    """`deepspeed`, imported without the `mlflow` import its autotuner makes at import time.

    DeepSpeed's autotuner (never used by elastictrain; the driver does all MLflow logging) imports MLflow
    when it can, which pulls in pandas, FastAPI and more: 1.5 s of the 4.2 s a worker spent importing
    DeepSpeed and transformers on a 2-core machine, paid by every new worker, so by every cold start
    and every replacement. `mlflow` is importable again as soon as DeepSpeed is in.
    """
    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        import deepspeed

        return deepspeed
    sys.modules["mlflow"] = None  # type: ignore[assignment]  # makes `import mlflow` raise ImportError
    try:
        import deepspeed
    finally:
        if "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]
    return deepspeed


def load_op(name: str) -> None:
    """Load DeepSpeed's op `name` into this process where this machine can run it (a no-op once loaded)."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(name)
    if builder is not None and builder.is_compatible(verbose=False):
        builder.load(verbose=False)


def build_ops(use_gpu: bool = False) -> dict[str, str]:
    prefer_environment_tools()
    remember_cpu_info()  # probed here, once: saved for every worker that starts after
    if not use_gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import_deepspeed()
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
