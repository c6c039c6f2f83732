"""How a worker imports DeepSpeed and how DeepSpeed asks about the CPU: two costs paid on every restart's
critical path, cut by replacing what DeepSpeed calls."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastictrain.compat.registry import has_parameters, patch
from elastictrain.user_cache import cache_folder, save_whole


def _check_cpuinfo() -> str | None:
    import cpuinfo

    if not callable(getattr(cpuinfo, "get_cpu_info", None)):
        return "cpuinfo has no get_cpu_info"
    return has_parameters(cpuinfo.get_cpu_info, where="cpuinfo.get_cpu_info")  # takes no arguments


def _do_nothing() -> None:
    return None


def _check_import() -> str | None:
    return None  # nothing is replaced: only `import mlflow` is made to fail while deepspeed imports


def _import_plainly() -> Any:
    import deepspeed

    return deepspeed


@patch(
    "cpu_info_remembered",
    package="py-cpuinfo",
    tested=">=9.0",
    kind="performance",
    check=_check_cpuinfo,
    otherwise=_do_nothing,
)
def remember_cpu_info() -> None:
    """Make py-cpuinfo's `get_cpu_info` ask once per machine: at the first call, then from a file.

    What: `cpuinfo.get_cpu_info` (which DeepSpeed imports from py-cpuinfo at each call) is replaced by a
    function that returns a copy of the first answer.
    Why: each call starts a Python subprocess that probes the CPU: 1.1 s here. DeepSpeed calls it whenever it
    loads a CPU op (twice, for its compiler flags) and whenever it creates its CPU Adam: a CPU-offload
    engine build spent 3.4 s of 4.3 in it at 30M, an NVMe one 5.7 s of 6.8, on every restart's
    critical path, and every worker's warm-up 2.3 s. The answer is kept for the process, and in a file
    named after the CPU's own description (`cpu_fingerprint`), so another CPU never reads it. Each
    caller gets its own copy.
    Retired by: DeepSpeed caching the CPU description per process in its op builders (`cpu_arch`,
    `simd_width`) and CPU Adam; no upstream issue found.
    """
    import functools

    import cpuinfo

    if getattr(cpuinfo.get_cpu_info, "remembered", False):
        return
    probe = cpuinfo.get_cpu_info
    asked_once = functools.cache(lambda: cpu_info_from_file(probe, cache_folder()))

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
        with contextlib.suppress(TypeError, ValueError):  # not JSON: unsaved, the next process probes again
            save_whole(path, json.dumps(info).encode())  # whole or absent, for workers starting together
    return info


@patch(
    "deepspeed_imported_without_mlflow",
    package="deepspeed",
    kind="performance",
    check=_check_import,
    otherwise=_import_plainly,
)
def import_deepspeed() -> Any:
    """`deepspeed`, imported without the `mlflow` import its autotuner makes at import time.

    What: `sys.modules["mlflow"]` is None while `import deepspeed` runs, so DeepSpeed's optional
    `import mlflow` raises ImportError; `mlflow` is importable again as soon as DeepSpeed is in.
    Why: DeepSpeed's autotuner (never used by elastictrain; the driver does all MLflow logging) imports
    MLflow when it can, which pulls in pandas, FastAPI and more: 1.5 s of the 4.2 s a worker spent
    importing DeepSpeed and transformers on a 2-core machine, paid by every cold start and replacement.
    Retired by: DeepSpeed importing its autotuner's MLflow lazily, where the autotuner logs; no upstream
    issue found.
    """
    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        import deepspeed
    else:
        sys.modules["mlflow"] = None  # type: ignore[assignment]  # makes `import mlflow` raise ImportError
        try:
            import deepspeed
        finally:
            if "mlflow" in sys.modules and sys.modules["mlflow"] is None:
                del sys.modules["mlflow"]
    compile_lazily()
    return deepspeed


def _check_compiler() -> str | None:
    import deepspeed.runtime.compiler as compiler

    # A decorator factory (no parameters); a missing one is "not callable".
    return has_parameters(getattr(compiler, "compile", None), where="deepspeed.runtime.compiler.compile")


@patch(
    "torch_compile_deferred_to_first_call",
    package="deepspeed",
    kind="performance",
    check=_check_compiler,
    otherwise=_do_nothing,
)
def compile_lazily() -> None:
    """Make `deepspeed.runtime.compiler.compile()` decorate with `torch.compile` at the first call, not at
    import.

    What: `compile()` returns a decorator whose function calls `torch.compile(fn)` the first time it is
    called and the compiled function from then on. torch.compile compiles at the first call anyway, so
    what runs is the same; only the import of torch's compiler moves there.
    Why: DeepSpeed's Muon optimizer module (imported with its engine, whatever the optimizer) decorates three
    functions with `@compiler.compile()` at import, and `torch.compile` imports TorchInductor to do so:
    0.7-0.9 s of CPU in each worker's warm-up of 4-5 s (a tiny model, 2 cores), paid again by every
    replacement, for an optimizer elastictrain's users rarely pick. Applies only while the Muon module is
    not yet imported (its decorations happen once).
    Retired by: DeepSpeed importing its Muon module only when Muon is configured, or decorating lazily; no
    upstream issue found.
    """
    import deepspeed.runtime.compiler as compiler

    compiler.compile = deferred_compile  # type: ignore[assignment]


def deferred_compile() -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A stand-in for `torch.compile` as a bare decorator: compiles `fn` at its first call."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        compiled: Callable[..., Any] | None = None

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                import torch

                compiled = torch.compile(fn)
            return compiled(*args, **kwargs)

        return call

    return decorate
