"""Every change elastictrain makes to the internals of DeepSpeed, torch.distributed (gloo), transformers,
MLflow and py-cpuinfo, in one place: nothing outside this package names a private attribute of those
packages (tests/unit/test_compat_private_names.py reads the source for it).

Each change is a patch: a named function whose docstring says what it changes, why, and what upstream
change would retire it, declared in `registry.PATCHES` with the package, the releases it was checked on,
its kind, what it gains a user and a check of its target's shape. A patch earns its place by what a user
gains (memory or recovery time at 125M and more, a correctness or design need), never by seconds of a
process's imports; no patch stands a module in for another in `sys.modules`
(tests/unit/test_no_import_standins.py). `registry` says what happens outside the tested range; the list
with its ranges is docs/reference/deepspeed-compatibility.md (`python -m elastictrain.compat.table`).

- deepspeed/: process-wide state between attempts (process_state.py), py-cpuinfo's probe (cpu_info.py),
  the ZeRO-3 engine build (zero3_build.py), its memory (zero3_memory.py), NVMe swap buffers
  (swap_buffers.py), the optimizer state that elastic checkpoints read and write (optimizer_state.py) and
  steps with non-finite gradients left unapplied without ZeRO (skip_update.py)
- torch_dist/: gloo gathers in pieces (gloo_gather.py), gloo's sockets (collective_sockets.py), NCCL's
  abort (process_group.py)
- transformers/: weight initialization under ZeRO-3 (hf_init.py), a model class built from its config
  (preload.py)
- mlflow/: the artifact location cache (artifact_cache.py)
- per_thread.py: a package function replaced for the threads inside a block only (the weight-init patches)
"""

from elastictrain.compat.registry import (
    DEEPSPEED_TESTED,
    PATCHES,
    CompatError,
    CompatWarning,
    Patch,
    active,
    all_patches,
    check_all,
    refuse_unsupported_versions,
)

__all__ = [
    "DEEPSPEED_TESTED",
    "PATCHES",
    "CompatError",
    "CompatWarning",
    "Patch",
    "active",
    "all_patches",
    "check_all",
    "refuse_unsupported_versions",
]
