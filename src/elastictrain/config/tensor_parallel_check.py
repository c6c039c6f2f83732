"""What a tensor-parallel layout needs of the config: whole replicas, and layers that split evenly.

With `scaling.tensor_parallel: N` the world is world_size / N data-parallel replicas of N ranks
(DeepSpeed's AutoTP slices each attention's heads and each MLP's hidden units between them), so every
world size the run may take must be a multiple of N, and the model's heads must divide by N.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Where a model built from model.hf_config says how many heads and hidden units it splits.
_SPLIT_SIZES = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


def user_json_tensor_parallel(user: dict[str, Any]) -> Any:
    """The tensor-parallel degree a DeepSpeed JSON asks for (1 when it has no tensor_parallel block)."""
    tp = user.get("tensor_parallel") if isinstance(user.get("tensor_parallel"), dict) else {}
    return tp.get("autotp_size", tp.get("tp_size", 1))


def adopt_user_json_tensor_parallel(config: Any) -> None:
    """Take the degree from the user's DeepSpeed JSON (unchanged) where scaling.tensor_parallel is 1.

    An unreadable file is left to the JSON's own check, which names it; a conflict between the two is
    reported there too."""
    path = Path(config.deepspeed.config_file or "")
    if config.scaling.tensor_parallel != 1 or not config.deepspeed.config_file or not path.is_file():
        return
    try:
        user = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    found = user_json_tensor_parallel(user) if isinstance(user, dict) else 1
    if isinstance(found, int) and not isinstance(found, bool) and found > 1:
        config.scaling.tensor_parallel = found


def checked_degree(config: Any) -> int:
    """The degree world sizes are checked at when the config loads (auto: one is chosen at start)."""
    n = config.scaling.tensor_parallel
    return 1 if n == "auto" else n


def tensor_parallel_candidates(config: Any) -> list[int]:
    """The degrees `tensor_parallel: auto` may choose from, smallest first: those the config can hold
    (whole replicas in min, max and spare workers, heads that split, a global batch that splits)."""
    from elastictrain.config.layout_check import micro_batch_cap
    from elastictrain.core.batch import workable_world_sizes

    s, t = config.scaling, config.training
    out = []
    for n in range(1, max(1, s.max_workers) + 1):
        trial = _with_degree(config, n)
        if n > 1 and tensor_parallel_problems(trial):
            continue
        if workable_world_sizes(
            t.global_batch_size, micro_batch_cap(config), s.min_workers, s.max_workers, n
        ):
            out.append(n)
    return out


def _with_degree(config: Any, n: int) -> Any:
    import copy

    trial = copy.copy(config)
    trial.scaling = copy.copy(config.scaling)
    trial.scaling.tensor_parallel = n
    return trial


def whole_replica_problems(scaling: Any, field: str, n: int, of: str) -> list[str]:
    """min, max and spare workers that are not whole replicas of `n` (scaling.`field`: N `of` each)."""
    p = []
    for key in ("min_workers", "max_workers", "spare_workers"):
        value = getattr(scaling, key)
        if value % n:
            fits = sorted({value // n * n, (value // n + 1) * n} - {0})
            p.append(
                f"scaling.{key}: got {value} with scaling.{field} {n}; it counts ranks and must be a "
                f"multiple of {n} (whole replicas of {n} {of}): {' or '.join(map(str, fits))}"
            )
    return p


def tensor_parallel_problems(config: Any) -> list[str]:
    s = config.scaling
    n = s.tensor_parallel
    if n == "auto":
        if not tensor_parallel_candidates(config):
            return [
                "scaling.tensor_parallel: got 'auto' but no degree fits scaling.min_workers, max_workers "
                "and the model's heads; set a number"
            ]
        return []
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return [
            f"scaling.tensor_parallel: got {n!r}; expected a whole number >= 1 (1: no tensor parallelism)"
        ]
    if n == 1:
        return []
    p = whole_replica_problems(s, "tensor_parallel", n, "ranks")
    if config.model.lora.enabled:
        p.append(
            f"model.lora.enabled: LoRA with scaling.tensor_parallel {n} is not supported: peft's adapters "
            "inside the layers AutoTP slices fail to build; train LoRA with tensor_parallel 1 (ZeRO-3 "
            "splits a large base model instead)"
        )
    if config.model.pretrained and config.deepspeed.zero_stage == 3 and not config.deepspeed.config_file:
        p.append(
            f"deepspeed.zero_stage: got 3 with model.pretrained and scaling.tensor_parallel {n}; "
            "transformers cannot load a pretrained folder under ZeRO-3 into AutoTP's slices yet; "
            "use stage 1 or 2"
        )
    if not (config.model.factory or config.model.pretrained):
        hf = config.model.hf_config
        for key in _SPLIT_SIZES:
            value = hf.get(key)
            if isinstance(value, int) and value % n:
                p.append(
                    f"model.hf_config.{key}: got {value}; scaling.tensor_parallel {n} splits it between "
                    f"{n} ranks, so it must be a multiple of {n}"
                )
    return p
