"""Pipeline parallelism (issue 62): a transformers Llama split into DeepSpeed pipeline stages trains the
plain PyTorch loop's losses. Real DeepSpeed pipeline engines in separate processes (gloo on CPU): P 2 x D 1
under ZeRO-0, against the reference loop within the tolerance derived as in
test_plain_pytorch_equivalence (10x the difference between two reference runs that differ only in the
order of their sums)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from helpers import tiny_config
from reference import global_batch, reference_model, train_reference

from elastictrain.data.sources import dataset_from_config

pytestmark = pytest.mark.integration

STEPS = 6


def _config(run_dir: Path) -> Any:
    return tiny_config(run_dir, f"training.max_steps={STEPS}", "model.hf_config.tie_word_embeddings=false")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, stages: int, port: int, run_dir: str, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0"
    )
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)
    import deepspeed

    from elastictrain.core.schedule import step_learning_rate
    from elastictrain.model.pipeline import pipeline_module, stage_layers

    deepspeed.init_distributed(dist_backend="gloo")
    cfg = _config(Path(run_dir))
    t = cfg.training
    replicas = world // stages
    module = pipeline_module(stage_layers(reference_model(cfg)), stages, replicas)
    optimizer = torch.optim.AdamW(
        module.parameters(),
        lr=t.lr,
        betas=(t.adam_beta1, t.adam_beta2),
        eps=t.adam_eps,
        weight_decay=t.weight_decay,
    )
    micro = t.micro_batch_size
    accumulation = t.global_batch_size // (micro * replicas)
    engine, *_ = deepspeed.initialize(
        model=module,
        optimizer=optimizer,
        config={
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": accumulation,
            "gradient_clipping": t.grad_clip,
            "zero_optimization": {"stage": 1 if replicas > 1 else 0},
            "steps_per_print": 10**9,
        },
    )
    dataset = dataset_from_config(cfg)
    replica = rank // stages
    losses = []
    for step in range(STEPS):
        for group in engine.optimizer.param_groups:
            group["lr"] = step_learning_rate(step, t)
        batch = global_batch(cfg, dataset, step)
        # Micro-step k of replica d reads slot k * D + d of the step's samples, as every layout does.
        slots = [
            batch[(k * replicas + replica) * micro : (k * replicas + replica + 1) * micro]
            for k in range(accumulation)
        ]
        losses.append(float(engine.train_batch(iter([(ids, ids) for ids in slots]))))
    Path(out, f"rank{rank}.json").write_text(json.dumps({"losses": losses, "stage": engine.stage_id}))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()  # before the interpreter's exit tears the groups down in any order


def _train(tmp_path: Path, stages: int, world: int) -> dict[int, dict[str, Any]]:
    out = tmp_path / f"p{stages}-w{world}"
    out.mkdir()
    mp.start_processes(
        _rank,
        args=(world, stages, _free_port(), str(tmp_path / "run"), str(out)),
        nprocs=world,
        start_method="spawn",
    )
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(world)}


# P 2 x D 1 only: D 2 under ZeRO-1 is what test_pipeline_runs.py trains through the product, against the
# same reference (here it cost 24 s of a 2-core suite for no path of its own).
@pytest.mark.parametrize(("stages", "world"), [(2, 2)], ids=["p2xd1-z0"])
def test_pipeline_stages_train_the_plain_pytorch_losses(tmp_path: Path, stages: int, world: int) -> None:
    got = _train(tmp_path, stages, world)
    assert sorted(r["stage"] for r in got.values()) == sorted(r % stages for r in range(world))
    cfg = _config(tmp_path / "run")
    dataset = dataset_from_config(cfg)
    want, _ = train_reference(cfg, dataset, STEPS)
    split, _ = train_reference(cfg, dataset, STEPS, micro_batches=6)
    tol = 10 * max(max(abs(a - b) for a, b in zip(want, split, strict=True)), 1.2e-7 * max(want))
    for rank, result in got.items():  # every stage reports the step's loss (the last stage's, broadcast)
        worst = max(abs(a - b) for a, b in zip(result["losses"], want, strict=True))
        assert worst <= tol, (rank, worst, tol, result["losses"], want)
