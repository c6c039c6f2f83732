"""training.num_epochs on 2 Ray workers: the step count from the training set's size, and a sample ledger
showing every training sample num_epochs times (core/epochs.py: the last step's fill from the next
epoch once more); `resume RUN training.num_epochs=N` extends the run from the recorded epoch_samples."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from helpers import TINY, run

from elastictrain.config import load_config
from elastictrain.core.data_order import epoch_permutation, held_out
from elastictrain.launch import apply_resume_changes
from elastictrain.run_length import resolve_length

pytestmark = pytest.mark.integration

# 11 generated samples of 64 bytes; eval.split=0.2 holds out 2: 9 training samples, global batch 4.
EPOCHS = (
    "data.generated_chars=704",
    "eval.split=0.2",
    "training.global_batch_size=4",
    "training.micro_batch_size=2",
    "training.num_epochs=3",
    "training.warmup_ratio=0.2",
    "checkpoint.every_steps=5",
    "tracking.plots=false",
    "tracking.system_metrics=false",
)


def ledger_hook(records: list[tuple[int, int, list[int]]]) -> Any:
    def hook(controller: Any) -> None:
        controller.ledger = lambda step, rank, ids: records.append((step, rank, list(ids)))

    return hook


def last_reading(records: list[tuple[int, int, list[int]]]) -> Counter[int]:
    """Each step's ids as last reported (a step run again after a failure counts once)."""
    by_step: dict[tuple[int, int], list[int]] = {}
    for step, rank, ids in records:
        by_step[(step, rank)] = ids
    return Counter(i for ids in by_step.values() for i in ids)


def resume_with(run_dir: Path, *overrides: str) -> Any:
    """What `elastictrain resume RUN_DIR OVERRIDES` does before it trains (cli.resume)."""
    from elastictrain.rundir.run_dir import RunDir

    rd = RunDir.open(run_dir)
    cfg = load_config(rd.config_yaml, list(overrides))
    resolve_length(cfg)
    apply_resume_changes(rd, cfg)
    return cfg


def test_three_epochs_read_each_training_sample_three_times_then_a_fourth_extends_it(ray_local, tmp_path):
    cfg = load_config(TINY, [f"run.dir={tmp_path / 'run'}", *EPOCHS])  # the file's max_steps is replaced
    lines = resolve_length(cfg)
    # 9 x 3 = 27 positions -> 7 steps of 4; the 28th position is the first sample of epoch 4's order.
    assert (cfg.training.epoch_samples, cfg.training.max_steps, cfg.training.warmup_steps) == (9, 7, 2)
    assert "= 7 steps" in lines[1]
    records: list[tuple[int, int, list[int]]] = []
    summary, run_dir, _ = run(cfg, tracking=False, hook=ledger_hook(records))
    assert summary.status.value == "FINISHED" and summary.step == 7
    written = load_config(run_dir.config_yaml).training
    assert (written.max_steps, written.num_epochs, written.epoch_samples) == (7, 3, 9)

    train_ids, held = held_out(11, 0.2, cfg.training.seed)
    fill = train_ids[epoch_permutation(9, cfg.training.seed, 3)[0]]
    read = last_reading(records)
    assert set(read) == set(train_ids) and not set(read) & set(held)
    assert read == Counter({i: 4 if i == fill else 3 for i in train_ids})

    longer = resume_with(run_dir.path, "training.num_epochs=4")
    assert (longer.training.max_steps, longer.training.warmup_steps) == (9, 2)  # 36 positions; warmup kept
    summary, _, _ = run(longer, tracking=False, hook=ledger_hook(records))
    assert summary.status.value == "FINISHED" and summary.step == 9
    assert last_reading(records) == Counter({i: 4 for i in train_ids})


def test_sft_records_three_epochs_through_the_cli_then_resume_adds_one(ray_local, tmp_path, monkeypatch):
    """`elastictrain train` prints the computed steps and writes them to config.yaml; `elastictrain resume
    RUN training.num_epochs=4` trains one more pass. 12 alpaca records, global batch 4: 9 steps, then 12."""
    from sft_fixtures import make_chatml_tokenizer, write_records
    from typer.testing import CliRunner

    from elastictrain.cli import app

    ledger = tmp_path / "ledger.jsonl"
    monkeypatch.setenv("ELASTICTRAIN_SAMPLE_LEDGER", str(ledger))
    run_dir = tmp_path / "run"
    overrides = [
        f"run.dir={run_dir}",
        "data.source=sft",
        f"data.path={write_records(tmp_path / 'data', 'alpaca', 12)}",
        f"data.tokenizer={make_chatml_tokenizer(tmp_path / 'tok')}",
        "data.packing=false",
        "training.global_batch_size=4",
        "training.micro_batch_size=2",
        "training.num_epochs=3",
        "checkpoint.every_steps=5",
        "tracking.plots=false",
        "tracking.system_metrics=false",
    ]
    cli = CliRunner()
    trained = cli.invoke(app, ["train", "-c", str(TINY), "--no-tracking", *overrides])
    assert trained.exit_code == 0, trained.output
    assert "training.num_epochs=3: 12 training samples x 3 / global batch 4 = 9 steps" in trained.output
    assert load_config(run_dir / "config.yaml").training.max_steps == 9

    def reads() -> Counter[int]:
        records = [json.loads(line) for line in ledger.read_text().splitlines()]
        return last_reading([(r["step"], r["rank"], r["ids"]) for r in records])

    assert reads() == Counter({i: 3 for i in range(12)})
    more = cli.invoke(app, ["resume", str(run_dir), "--no-tracking", "training.num_epochs=4"])
    assert more.exit_code == 0, more.output
    assert "training.max_steps: 9 -> 12" in more.output and "training.num_epochs: 3.0 -> 4" in more.output
    assert reads() == Counter({i: 4 for i in range(12)})
