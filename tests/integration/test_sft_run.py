"""Instruction data in a real run: a LLaMA-Factory data folder (an alpaca and a sharegpt dataset, columns
renamed), 2 Ray workers under ZeRO-3, variable-length records padded per micro-batch, a held-out
validation set, the driver's checks first as `elastictrain train` makes them."""

from __future__ import annotations

import math

import pytest
from helpers import record_losses, run, tiny_config
from sft_fixtures import make_chatml_tokenizer, write_dataset_info

pytestmark = pytest.mark.integration


def test_two_datasets_of_a_dataset_info_folder_train_at_two_workers_under_zero3(ray_local, tmp_path):
    from elastictrain.launch import check_before_start

    tok = make_chatml_tokenizer(tmp_path / "tok")
    folder = write_dataset_info(tmp_path / "data", qa=24, chats=24)
    cfg = tiny_config(
        tmp_path / "run",
        "data.source=sft",
        f"data.dataset_dir={folder}",
        "data.dataset=qa,chats",
        f"data.tokenizer={tok}",
        "data.packing=false",
        "data.system=be brief",
        "deepspeed.zero_stage=3",
        "scaling.min_workers=2",
        "scaling.max_workers=2",
        "training.max_steps=4",
        "training.global_batch_size=8",
        "eval.split=0.1",
        "eval.steps=1",
    )
    check_before_start(cfg)  # the records are built and checked on the driver first
    losses: list[float] = []
    summary, run_dir, output = run(cfg, tracking=False, hook=record_losses(losses))
    assert summary.status.value == "FINISHED" and summary.step == 4, output
    assert len(losses) == 4 and all(math.isfinite(x) and x > 0 for x in losses), losses
    assert set(summary.world_sizes) == {2}
    evals = [e for e in run_dir.read_events() if e["event"] == "eval"]
    assert evals and evals[-1]["eval_samples"] == 8 and math.isfinite(evals[-1]["eval_loss"]), output
