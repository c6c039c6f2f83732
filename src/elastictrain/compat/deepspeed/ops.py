"""Build DeepSpeed's JIT-compiled ops once, into a cache of this environment's own.

Not a patch (DeepSpeed's public op builders): kept beside the patches as the way elastictrain installs
DeepSpeed. A first NVMe-offload run otherwise spends minutes compiling inside the first training step;
doing it at install time keeps that cost out of runs, tests and benchmarks. The cache lies under
~/.cache/torch_extensions/elastictrain-<key> (one per DeepSpeed install) unless TORCH_EXTENSIONS_DIR
says where.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys
import time
from pathlib import Path

from elastictrain.compat.deepspeed.cpu_info import remember_cpu_info

OPS = ("CPUAdamBuilder", "AsyncIOBuilder", "ShareMemCommBuilder")


def prefer_environment_tools() -> None:
    """Put this interpreter's bin folder first on PATH, and give DeepSpeed's ops this environment's own
    cache (`own_extensions_dir`, unless TORCH_EXTENSIONS_DIR is set), once per process.

    An inherited TORCH_EXTENSIONS_DIR that is another install's own cache (set by a process of another
    environment, e.g. a test driving `make test-compat`) is replaced, not honoured: this install's ops
    compiled there would make that install compile its own again (minutes, inside its next run).

    DeepSpeed's ops are compiled and checked with the `ninja` found on PATH. The environment's ninja
    (a dependency of DeepSpeed) and a system one differ in version, and each takes the other's build
    log for a stale build: a process started without the environment on PATH rebuilt every op
    (minutes each) while every rank waited on the build lock, and the next one rebuilt them back.
    """
    bin_dir = str(Path(sys.executable).parent)
    parts = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p]
    if not parts or parts[0] != bin_dir:
        os.environ["PATH"] = os.pathsep.join([bin_dir, *(p for p in parts if p != bin_dir)])
    own = own_extensions_dir()
    inherited = os.environ.get("TORCH_EXTENSIONS_DIR")
    if inherited is None or _another_installs_cache(Path(inherited), own):
        os.environ["TORCH_EXTENSIONS_DIR"] = str(own)
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if arch_list:
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list_deepspeed_reads(arch_list)


# "9.0a" (Hopper's arch-specific target) or "10.0f": DeepSpeed's builders read the minor as an int
_ARCH_SUFFIX = re.compile(r"^(\d+)\.(\d+)[a-z]+(\+PTX)?$")


def arch_list_deepspeed_reads(arch_list: str) -> str:
    """TORCH_CUDA_ARCH_LIST with arch-specific targets ("9.0a") written as their plain arch ("9.0").

    DeepSpeed's op builders parse each entry's minor as an integer and fail on "0a" ("invalid literal
    for int() with base 10: '0a'"), which stopped NVMe offload (its async I/O op) on a GPU image whose
    environment sets TORCH_CUDA_ARCH_LIST="9.0a". DeepSpeed's ops use no arch-specific instruction, so
    the plain target runs them on the same chip. Other entries and separators are kept as they are.
    """
    tokens = re.split(r"([;\s]+)", arch_list)
    return "".join(_ARCH_SUFFIX.sub(lambda m: f"{m[1]}.{m[2]}{m[3] or ''}", t) for t in tokens)


def _another_installs_cache(path: Path, own: Path) -> bool:
    """Whether `path` is an `own_extensions_dir` of another DeepSpeed install (not a user's choice)."""
    return path != own and path.parent == own.parent and path.name.startswith("elastictrain-")


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
