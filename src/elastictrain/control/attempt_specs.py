"""What each rank of a new attempt is told: its AttemptSpec, built from the run's config and placement."""

from __future__ import annotations

from typing import Any

from elastictrain.config.deepspeed_config import build_deepspeed_config, for_rank
from elastictrain.core.batch import BatchPlan
from elastictrain.worker.attempt import AttemptSpec


def attempt_specs(
    cfg: Any,
    *,
    attempt: int,
    plan: BatchPlan,
    run_id: str,
    master_addr: str,
    port: int,
    checkpoint_dir: str | None,
    start_step: int,
    node_ids: list[str],
) -> list[AttemptSpec]:
    """One spec per rank; rank r runs on node_ids[r] (ranks sharing a node share its host memory)."""
    size = len(node_ids)
    ds_config = build_deepspeed_config(cfg, plan.micro_batch_size, plan.grad_accum_steps, size)
    return [
        AttemptSpec(
            attempt=attempt,
            rank=rank,
            world_size=size,
            master_addr=master_addr,
            master_port=port,
            backend="nccl" if cfg.scaling.use_gpu else "gloo",
            plan=plan,
            config=cfg,
            ds_config=for_rank(ds_config, run_id, rank),
            checkpoint_dir=checkpoint_dir,
            start_step=start_step,
            ranks_on_node=node_ids.count(node_ids[rank]),
        )
        for rank in range(size)
    ]
