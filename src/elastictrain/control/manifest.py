"""The fields of a checkpoint's manifest that the run adds (the store adds format, tag, step, files)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from elastictrain.checkpoint.model_record import configured_model
from elastictrain.core.batch import BatchPlan
from elastictrain.rundir.run_dir import RunDir, RunInfo


def manifest_fields(
    config: Any,
    *,
    world_size: int,
    plan: BatchPlan,
    samples: int,
    engine_state: dict[str, Any],
    info: RunInfo,
    built: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`built`: the model as rank 0 built it (checkpoint/model_record.py), None where none reported it."""
    seed = config.training.seed
    return {
        "world_size": world_size,
        "samples_consumed": samples,
        "data_position": {"samples_consumed": samples, "seed": seed},
        "rng": {"scheme": "torch reseeded per micro-batch from (training.seed, data position)", "seed": seed},
        "global_batch_size": config.training.global_batch_size,
        "plan": {"micro_batch_size": plan.micro_batch_size, "grad_accum_steps": plan.grad_accum_steps},
        "engine_state": engine_state,
        "model": {**configured_model(config), **({"built": built} if built is not None else {})},
        "run_id": info.run_id,
        "config_digest": info.config_digest,
    }


def manifest_for(
    config: Any, run_dir: RunDir, size: int, plan: BatchPlan
) -> Callable[[int, dict[str, Any], dict[str, Any] | None], dict[str, Any]]:
    """The manifest fields of an attempt's checkpoints, as a function of (step, engine state, built model)."""

    def fields(
        step: int, engine_state: dict[str, Any], built: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        samples = step * config.training.global_batch_size
        return manifest_fields(
            config,
            world_size=size,
            plan=plan,
            samples=samples,
            engine_state=engine_state,
            info=run_dir.read_info(),
            built=built,
        )

    return fields
