"""examples/sft as docs/instruction-data.md runs it: `prepare.py`, `elastictrain preview-data`, then
`elastictrain train -c examples/sft/config.yaml` and `elastictrain resume RUN training.num_epochs=4`.

One run covers instruction data in a real run and training.num_epochs: two datasets of a LLaMA-Factory
data folder (alpaca and sharegpt), LoRA on a small pretrained model, 2 Ray workers under ZeRO-3,
records padded per micro-batch, data.system, a held-out split validated at the end, warmup_ratio, 3
epochs as a step count computed at start; then a resume extends it to 4 epochs. The sample ledger
(ELASTICTRAIN_SAMPLE_LEDGER) shows every training sample read once per epoch, the last step's fill
from the next epoch's order once more, and no held-out sample. The epoch arithmetic itself is
unit-tested (tests/unit/test_core_run_length.py, test_run_length_config.py), as are dataset_info.json's
renamed columns and tags (test_sft_records.py, test_sft_dataset.py).
"""

from __future__ import annotations

import json
import math
import re
import runpy
import sys
from collections import Counter
from pathlib import Path

import pytest
from helpers import KEEP_WARM, REPO
from typer.testing import CliRunner

from elastictrain.cli import app
from elastictrain.config import load_config
from elastictrain.core.data_order import epoch_permutation, held_out
from elastictrain.rundir.run_dir import RunDir

pytestmark = pytest.mark.integration

EXAMPLE = REPO / "examples" / "sft"
STEP_LINE = re.compile(r"^step (\d+)/\d+ loss (\S+) .* world (\d+) ", re.MULTILINE)


def last_reading(ledger: Path) -> Counter[int]:
    """Each sample id's reads, each step's ids as last reported (a step run again counts once)."""
    by_step: dict[tuple[int, int], list[int]] = {}
    for line in ledger.read_text().splitlines():
        r = json.loads(line)
        by_step[(r["step"], r["rank"])] = r["ids"]
    return Counter(i for ids in by_step.values() for i in ids)


def test_the_sft_example_trains_three_epochs_on_two_workers_then_resume_adds_a_fourth(
    ray_local, tmp_path, monkeypatch
):
    work = tmp_path / "work"
    # `python examples/sft/prepare.py work/`, in this process (its imports are paid already).
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE / "prepare.py"), str(work)])
    runpy.run_path(str(EXAMPLE / "prepare.py"), run_name="__main__")

    # The example's paths are relative to the repository root; the Ray workers' working folder is not
    # tmp_path, so they are given absolute. The first 6 records of each dataset: 12, of which
    # eval.split=0.05 holds out 1. 11 x 3 = 33 positions is not a multiple of the batch of 4, so the
    # last step takes 3 samples of epoch 4's order; 11 x 4 = 44 is, so the resume ends on an epoch.
    data = [
        f"model.pretrained={work / 'sft-model'}",
        f"data.dataset_dir={work / 'sft-data'}",
        "data.max_samples=6",
        "data.system=be brief",
    ]
    cli = CliRunner()
    preview = cli.invoke(app, ["preview-data", "-c", str(EXAMPLE / "config.yaml"), *data, "--first", "1"])
    assert preview.exit_code == 0, preview.output
    # Alpaca record 0 has no system of its own: data.system is put first; the answer is marked trained.
    assert "<|im_start|>system\nbe brief<|im_end|>" in preview.output and "[[" in preview.output
    assert "1 of 11 samples" in preview.output, preview.output  # the training set, after the split

    ledger = tmp_path / "ledger.jsonl"
    monkeypatch.setenv("ELASTICTRAIN_SAMPLE_LEDGER", str(ledger))
    run_dir = tmp_path / "run"
    overrides = [
        f"run.dir={run_dir}",
        *data,
        "training.num_epochs=3",
        "training.global_batch_size=4",
        "training.micro_batch_size=2",
        "scaling.min_workers=2",  # the example allows 1: 2 from the start, every step at world size 2
        "tracking.plots=false",  # plots and system metrics only cost seconds here
        "tracking.system_metrics=false",
        KEEP_WARM,  # the resume below takes these workers
    ]
    trained = cli.invoke(app, ["train", "-c", str(EXAMPLE / "config.yaml"), "--no-tracking", *overrides])
    assert trained.exit_code == 0, trained.output
    said = trained.output
    assert "eval.split=0.05 holds out 1 of 12 samples" in said, said
    assert "training.num_epochs=3: 11 training samples x 3 / global batch 4 = 9 steps" in said, said
    assert "1 warmup steps of 9" in said, said  # the example's warmup_ratio=0.1
    t = load_config(run_dir / "config.yaml").training
    assert (t.max_steps, t.num_epochs, t.epoch_samples, t.warmup_steps) == (9, 3, 11, 1)

    steps = [(int(s), float(loss), int(world)) for s, loss, world in STEP_LINE.findall(said)]
    assert [s for s, _, _ in steps] == list(range(1, 10)), said
    assert all(math.isfinite(loss) and loss > 0 and world == 2 for _, loss, world in steps), steps
    events = RunDir.open(run_dir).read_events()
    evals = [e for e in events if e["event"] == "eval"]
    # eval.steps=2 batches of 4 read the 1 held-out record 8 times, at the end of the run.
    assert [e["step"] for e in evals] == [9] and evals[0]["eval_samples"] == 8, evals
    assert math.isfinite(evals[0]["eval_loss"]), evals
    assert (run_dir / "adapter" / "adapter_config.json").is_file()  # the LoRA adapter, at the finish

    seed = t.seed
    train_ids, held = held_out(12, 0.05, seed)
    fill = {train_ids[j] for j in epoch_permutation(11, seed, 3)[:3]}
    read = last_reading(ledger)
    assert not set(read) & set(held)
    assert read == Counter({i: 4 if i in fill else 3 for i in train_ids})

    more = cli.invoke(app, ["resume", str(run_dir), "--no-tracking", "training.num_epochs=4"])
    assert more.exit_code == 0, more.output
    assert "training.max_steps: 9 -> 11" in more.output and "training.num_epochs: 3.0 -> 4" in more.output
    assert load_config(run_dir / "config.yaml").training.warmup_steps == 1  # kept, not recomputed
    # The 4th epoch goes on from where the 3rd's fill left the order: each sample 4 times, none 5.
    assert last_reading(ledger) == Counter({i: 4 for i in train_ids})
