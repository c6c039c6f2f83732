"""The value each rank of an attempt is set up with (worker/attempt.py), built on the driver."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

from elastictrain.config.deepspeed_config import build_deepspeed_config, for_rank
from elastictrain.control.memory_recovery import MemoryLoad
from elastictrain.core.batch import BatchPlan, plan_batch
from elastictrain.data.preference.reference import ReferenceTable
from elastictrain.worker.attempt import AttemptSpec, MemorySource


def attempt_specs(
    cfg: Any,
    *,
    attempt: int,
    plan: BatchPlan,
    run_id: str,
    master: tuple[str, int],
    start_step: int,
    checkpoint_dir: str | None,
    buddies: Sequence[Any],
    memory: MemoryLoad | None,
    node_ids: Sequence[str],
    reference: ReferenceTable | None = None,
) -> list[AttemptSpec]:
    """One spec per rank; `memory` (the old ranks' in-memory snapshots) replaces the checkpoint load.
    Rank r runs on node_ids[r]: ranks sharing a node share its host memory."""
    size = len(buddies)
    ds_config = build_deepspeed_config(
        cfg,
        plan.micro_batch_size,
        plan.grad_accum_steps,
        plan.data_parallel,
        tensor_parallel=plan.tensor_parallel,
        pipeline_parallel=plan.pipeline_parallel,
    )
    source = None
    if memory is not None:
        p = memory.plan
        source = MemorySource(p.attempt, p.world_size, p.step, memory.holders)
    return [
        AttemptSpec(
            attempt=attempt,
            rank=rank,
            world_size=size,
            master_addr=master[0],
            master_port=master[1],
            backend="nccl" if cfg.scaling.use_gpu else "gloo",
            plan=plan,
            config=cfg,
            ds_config=for_rank(ds_config, run_id, rank),
            checkpoint_dir=None if source is not None else checkpoint_dir,
            start_step=start_step,
            snapshot_every=int(cfg.checkpoint.memory_every_steps),
            buddy=buddies[rank],
            memory=source,
            ranks_on_node=list(node_ids).count(node_ids[rank]),
            reference=reference,
        )
        for rank in range(size)
    ]


def single_rank_spec(cfg: Any, *, checkpoint_dir: str | None, start_step: int) -> AttemptSpec:
    """The one rank of a run in this process (`train --local`, `eval`): world size 1, a free loopback port."""
    plan = plan_batch(cfg.training.global_batch_size, cfg.training.micro_batch_size, 1)
    assert plan is not None  # any global batch splits at world size 1
    return AttemptSpec(
        attempt=1,
        rank=0,
        world_size=1,
        master_addr="127.0.0.1",
        master_port=loopback_port(),
        backend="nccl" if cfg.scaling.use_gpu else "gloo",
        plan=plan,
        config=cfg,
        ds_config=build_deepspeed_config(cfg, plan.micro_batch_size, plan.grad_accum_steps, 1),
        checkpoint_dir=checkpoint_dir,
        start_step=start_step,
    )


def replicas_text(plan: BatchPlan) -> str:
    """ "2 ranks", or with tensor or pipeline parallelism "2 replica(s) of 2 ranks": what reads distinct
    data."""
    if plan.replica_ranks == 1:
        return f"{plan.world_size} ranks"
    if plan.pipeline_parallel == 1:
        return f"{plan.data_parallel} replica(s) of {plan.tensor_parallel} tensor-parallel ranks"
    return f"{plan.data_parallel} replica(s) of {plan.pipeline_parallel} pipeline stages"


def loopback_port() -> int:
    """A free port on 127.0.0.1 for the single rank's process group."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def resize_reason(previous: int, size: int) -> str:
    """Why the world size became `size` (as recorded in the run's world-size history)."""
    if previous == 0:
        return "start"
    return "shrink" if size < previous else "grow" if size > previous else "restart"


def slowest_set_up(
    timings: dict[str, dict[str, float]], worker_ids: list[str] | None = None
) -> dict[str, Any]:
    """The slowest rank's set-up, in total and by part (each part's slowest rank), and the largest
    resident peak a rank had reached by its end (process lifetime: a warm actor's earlier attempts count).
    With `worker_ids` (in rank order) also each rank's set-up and load times, and from memory its time
    asking the holders: which rank was the slow one, and whether it waited on its peers."""
    parts = {
        "setup_s": "total_s",
        "process_group_s": "process_group_s",
        "engine_s": "engine_s",
        "load_s": "load_s",
        "setup_peak_rss_bytes": "peak_rss_bytes",
    }
    out: dict[str, Any] = {n: max(t.get(key, 0.0) for t in timings.values()) for n, key in parts.items()}
    by_rank = {"setup_s_by_rank": "total_s", "load_s_by_rank": "load_s"}
    by_rank["load_fetch_s_by_rank"] = "load_fetch_s"  # from memory: asking the holders for their pieces
    if worker_ids is not None:
        for name, key in by_rank.items():
            out[name] = [round(timings.get(w, {}).get(key, 0.0), 4) for w in worker_ids]
    return out


def set_up_peak_note(peak_bytes: float) -> str:
    """ ", peak N GiB resident on a rank" for the attempt's line (`peak_bytes`: slowest_set_up's
    setup_peak_rss_bytes); empty where no rank could say."""
    return f", peak {peak_bytes / (1 << 30):.2f} GiB resident on a rank" if peak_bytes else ""
