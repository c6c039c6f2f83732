"""Issue 37's last test: a LoRA fine-tune of a pretrained folder on chat records, exported merged, loads
with transformers, and its loss on answers it never trained on is below the base model's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import run, tiny_config
from pretrained_models import make_pretrained
from sft_fixtures import write_records
from typer.testing import CliRunner

from elastictrain.cli import app

pytestmark = pytest.mark.integration


def answer_loss(model: torch.nn.Module, dataset) -> float:  # noqa: ANN001 - an sft dataset
    """The mean loss per trained (answer) token over every record of `dataset`."""
    total, tokens = 0.0, 0
    with torch.no_grad():
        for i in range(len(dataset)):
            item = dataset[i]
            ids, labels = item["input_ids"][None], item["labels"][None]
            n = int((labels[:, 1:] != -100).sum())  # the tokens predicted: labels are shifted by the model
            total += float(model(input_ids=ids, labels=labels).loss) * n
            tokens += n
    return total / tokens


def test_a_lora_fine_tune_on_chat_records_exports_a_model_that_answers_held_out_records_better(
    ray_local, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from elastictrain.data.sources import dataset_from_config

    base = make_pretrained(tmp_path / "base", "qwen2")
    train_file = write_records(tmp_path / "train", "sharegpt", 96, seed=1)
    held_out_file = write_records(tmp_path / "held-out", "sharegpt", 24, seed=2)
    sft = ("data.source=sft", "data.packing=false", "data.seq_len=128", f"model.pretrained={base}")
    cfg = tiny_config(
        tmp_path / "run",
        *sft,
        f"data.path={train_file}",
        "model.lora.enabled=true",
        "model.lora.target_modules=all-linear",
        "model.lora.r=8",
        "training.max_steps=24",  # two epochs of 96 records at 8 a step
        "training.global_batch_size=8",
        "training.micro_batch_size=2",
        "training.lr=0.01",
        "checkpoint.every_steps=24",
        "scaling.min_workers=2",
        "scaling.max_workers=2",
    )
    summary, run_dir, output = run(cfg, tracking=False)
    assert summary.status.value == "FINISHED", output

    out = tmp_path / "merged"
    result = CliRunner().invoke(app, ["export", str(run_dir.path), "--out", str(out), "--merge-lora"])
    assert result.exit_code == 0, result.output
    merged, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info

    held_out = dataset_from_config(tiny_config(tmp_path / "unused", *sft, f"data.path={held_out_file}"))
    before = answer_loss(AutoModelForCausalLM.from_pretrained(base).eval(), held_out)
    after = answer_loss(merged.eval(), held_out)
    assert after < before - 0.1, f"held-out answer loss: base {before:.3f}, fine-tuned {after:.3f}"
