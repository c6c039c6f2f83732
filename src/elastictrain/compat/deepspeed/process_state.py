"""DeepSpeed's process-wide state that must not leak from one attempt to the next in a warm actor:
ZeRO-3's counters, the references that keep a dropped engine alive, the groups of the old world."""

from __future__ import annotations

import inspect
from typing import Any

from elastictrain.compat.registry import first_problem, has_attributes, patch

# deepspeed.utils.groups' module globals that hold process groups or sizes of a world (0.19.7 has no
# function that releases them; 0.19.8's `deepspeed.comm.destroy_process_group` does).
_GROUP_GLOBALS = (
    "_WORLD_GROUP",
    "_ZERO_PARAM_INTRA_PARALLEL_GROUP",
    "_TENSOR_MODEL_PARALLEL_GROUP",
    "_MODEL_PARALLEL_GROUP",
    "_DATA_PARALLEL_GROUP",
    "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE",
    "_MPU_TENSOR_MODEL_PARALLEL_RANK",
    "mesh_device",
    "mpu",
)
_GROUP_MAPS = (
    "_EXPERT_PARALLEL_GROUP",
    "_EXPERT_PARALLEL_GROUP_RANKS",
    "_EXPERT_DATA_PARALLEL_GROUP",
    "_EXPERT_DATA_PARALLEL_GROUP_RANKS",
    "_ALL_TO_ALL_GROUP",
)


def _check_counters() -> str | None:
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partition_parameters import Init, InsertPostInitMethodToModuleSubClasses

    register = getattr(DeepSpeedZeRoOffload, "_register_deepspeed_module", None)
    if register is None:
        return "DeepSpeedZeRoOffload has no _register_deepspeed_module"
    count = inspect.signature(register).parameters.get("count")
    default = None if count is None else count.default
    if not (isinstance(default, list) and len(default) == 1 and isinstance(default[0], int)):
        return "DeepSpeedZeRoOffload._register_deepspeed_module has no `count=[0]` default"
    return first_problem(
        has_attributes(Init, "param_id", "num_persisted_parameters", "num_persisted_elements"),
        has_attributes(
            InsertPostInitMethodToModuleSubClasses, "num_module_parameters", "num_module_elements"
        ),
    )


@patch(
    "zero3_counters_reset",
    package="deepspeed",
    kind="correctness",
    check=_check_counters,
    gains=(
        "correctness: warm and new actors number parameters alike; without it ZeRO-3's cross-rank checks "
        "fail after a restart"
    ),
)
def reset_zero_counters() -> None:
    """Reset ZeRO-3's process-wide parameter and module counters before an engine is built.

    What: the default argument `count=[0]` of `DeepSpeedZeRoOffload._register_deepspeed_module` (module
    ids), `Init.param_id`, `Init.num_persisted_parameters/elements` and
    `InsertPostInitMethodToModuleSubClasses.num_module_parameters/elements` go back to 0.
    Why: ranks must number parameters alike. A warm actor has built engines before and a replacement has
    not: without the reset their ids differ and ZeRO-3's cross-rank checks fail ("disagreement on list
    contents"). DeepSpeed assumes one engine per process.
    Retired by: DeepSpeed numbering parameters and modules per engine (or per zero.Init) rather than per
    process; no upstream issue found.
    """
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partition_parameters import Init, InsertPostInitMethodToModuleSubClasses

    module_counter = DeepSpeedZeRoOffload._register_deepspeed_module.__defaults__
    assert module_counter is not None  # checked: `count=[0]` is its only default
    module_counter[0][0] = 0
    Init.param_id = 0
    Init.num_persisted_parameters = 0
    Init.num_persisted_elements = 0
    InsertPostInitMethodToModuleSubClasses.num_module_parameters = 0
    InsertPostInitMethodToModuleSubClasses.num_module_elements = 0


_RELEASE_CACHE = "_PartitionedParameterCoordinator__params_to_release"  # a name-mangled lru_cache'd method


def _cached(method: Any) -> list[Any]:
    """The lru_cache under DeepSpeed's NVTX wrapper (a closure), or the method itself."""
    cells = [c.cell_contents for c in getattr(method, "__closure__", None) or ()]
    return [m for m in [method, *cells] if hasattr(m, "cache_clear")]


def _check_references() -> str | None:
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    if not isinstance(getattr(parameter_offload, "FWD_MODULE_STACK", None), list):
        return "deepspeed.runtime.zero.parameter_offload.FWD_MODULE_STACK is not a list"
    method = getattr(PartitionedParameterCoordinator, _RELEASE_CACHE, None)
    if method is None:
        return f"PartitionedParameterCoordinator has no {_RELEASE_CACHE}"
    return None if _cached(method) else f"{_RELEASE_CACHE} has no lru_cache to clear"


@patch(
    "engine_references_released",
    package="deepspeed",
    kind="memory",
    check=_check_references,
    gains=(
        "memory: a warm actor frees each attempt's engine: 1.8 GiB per rank per attempt at 125M; at 1B a "
        "survivor rebuilding beside a replacement ran the node out of memory without it"
    ),
)
def release_engine_references() -> None:
    """Empty the two process-wide places where ZeRO-3 keeps every engine it wrapped.

    What: `parameter_offload.FWD_MODULE_STACK` (the stack of modules in forward; the top module is pushed
    once and never popped) is cleared, and the unbounded `lru_cache` on
    `PartitionedParameterCoordinator.__params_to_release`, keyed by (coordinator, module), is emptied.
    Why: every engine a warm actor built stayed alive through its hooks: a 125M rank held 1.8 GiB more
    per attempt, and at 1B a survivor rebuilding its engine beside a replacement ran the node out of
    memory. No forward runs while an attempt is left, so both can be emptied.
    Retired by: `DeepSpeedEngine.destroy()` releasing both (a cache per coordinator instance rather than
    on the class, and the module stack popped at the end of forward); no upstream issue found.
    """
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    parameter_offload.FWD_MODULE_STACK.clear()
    for cached in _cached(getattr(PartitionedParameterCoordinator, _RELEASE_CACHE)):
        cached.cache_clear()


def _check_groups() -> str | None:
    import deepspeed.comm.comm as ds_comm_state
    from deepspeed.utils import groups

    if not hasattr(ds_comm_state, "cdb"):
        return "deepspeed.comm.comm has no cdb"
    if callable(getattr(groups, "_release_process_group_references", None)):
        return None  # 0.19.8: DeepSpeed's own release, called again here (harmless)
    missing = [n for n in (*_GROUP_GLOBALS, *_GROUP_MAPS) if not hasattr(groups, n)]
    if missing:
        return f"deepspeed.utils.groups has no _release_process_group_references, nor {', '.join(missing)}"
    return None


@patch(
    "process_groups_forgotten",
    package="deepspeed",
    kind="correctness",
    check=_check_groups,
    gains=(
        "correctness: the next attempt in a warm actor, at another world size, uses no group of the old "
        "world (it would fail or hang)"
    ),
)
def forget_process_groups() -> None:
    """Make DeepSpeed forget the process groups of the world just destroyed.

    What: `deepspeed.comm.comm.cdb` (its communication backend, bound to the old world) is set to None,
    and `deepspeed.utils.groups`' cached groups are released: with DeepSpeed's own
    `groups._release_process_group_references(group=None)` where it exists (0.19.8), else by resetting
    the same module globals it resets (0.19.7).
    Why: the next attempt runs in the same process at another world size; a group cached from the old
    world (data parallel, ZeRO's parameter group) would be used by the new engine and fail or hang.
    Retired by: DeepSpeed 0.19.8's `deepspeed.comm.destroy_process_group`, which releases the groups
    itself; this patch goes once the range starts at 0.19.8 and DeepSpeed also resets `cdb` there.
    """
    import deepspeed.comm.comm as ds_comm_state
    from deepspeed.utils import groups

    ds_comm_state.cdb = None
    release = getattr(groups, "_release_process_group_references", None)
    if callable(release):
        release(group=None)
        return
    for name in _GROUP_MAPS:
        getattr(groups, name).clear()
    for name in _GROUP_GLOBALS:
        setattr(groups, name, None)
    groups.expert_tensor_parallel_world_size = 1
