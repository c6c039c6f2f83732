"""`elastictrain preview-data` (text with trained spans marked, and --json), and `train` refusing bad
instruction records on the driver before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from sft_fixtures import make_chatml_tokenizer, write_records
from typer.testing import CliRunner

from elastictrain.cli import app
from elastictrain.cli.preview import json_sample

TINY = Path(__file__).resolve().parents[2] / "conf" / "tiny-cpu.yaml"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chatml_tokenizer(tmp_path_factory.mktemp("tok"))


def args(tok: Path, path: Path, *more: str) -> list[str]:
    return [
        "-c",
        str(TINY),
        "data.source=sft",
        f"data.path={path}",
        f"data.tokenizer={tok}",
        "data.packing=false",
        *more,
    ]


def test_preview_marks_the_trained_spans_and_json_gives_the_samples_in_order(tmp_path, tok):
    from elastictrain.config import load_config
    from elastictrain.data.sources import dataset_from_config

    path = write_records(tmp_path, "alpaca", 6)
    records = json.loads(path.read_text())
    text = CliRunner().invoke(app, ["preview-data", *args(tok, path), "--first", "2"])
    assert text.exit_code == 0, text.output
    for record in records[:2]:
        assert f"<|im_start|>assistant\n[[{record['output']}<|im_end|>\n]]" in text.output
    assert f"sample 1  {path} record 1" in text.output and "sample 2" not in text.output

    lines = CliRunner().invoke(app, ["preview-data", *args(tok, path), "--json", "--first", "4"])
    assert lines.exit_code == 0, lines.output
    samples = [json.loads(line) for line in lines.stdout.splitlines() if line.startswith("{")]
    dataset = dataset_from_config(load_config(TINY, args(tok, path)[2:]))
    assert [s["index"] for s in samples] == [0, 1, 2, 3]
    for s in samples:
        item = dataset[s["index"]]
        assert s["input_ids"] == item["input_ids"].tolist() and s["labels"] == item["labels"].tolist()
        assert set(s) == {"index", "input_ids", "labels"}


def test_a_packed_sample_s_position_ids_come_along_in_json():
    item = {
        "input_ids": torch.tensor([5, 6, 7]),
        "labels": torch.tensor([-100, 6, 7]),
        "position_ids": torch.tensor([0, 0, 1]),
    }
    assert json_sample(3, item) == {
        "index": 3,
        "input_ids": [5, 6, 7],
        "labels": [-100, 6, 7],
        "position_ids": [0, 0, 1],
    }


def test_train_refuses_bad_records_naming_them_before_any_worker_starts(tmp_path, tok):
    path = tmp_path / "bad.json"
    path.write_text(
        json.dumps([{"instruction": "a", "output": "b"}, {"instruction": "c"}, {"input": "", "output": "d"}])
    )
    result = CliRunner().invoke(app, ["train", *args(tok, path, f"run.dir={tmp_path / 'run'}")])
    assert result.exit_code == 2, result.output
    assert "data: 2 of 3 instruction records are bad" in result.output
    assert f"{path} record 1: output: missing" in result.output
    assert f"{path} record 2: instruction: empty" in result.output
    assert not (tmp_path / "run" / "run.json").exists()
    preview = CliRunner().invoke(app, ["preview-data", *args(tok, path)])
    assert preview.exit_code == 2 and "data.on_bad_record=skip" in preview.output
    skipped = CliRunner().invoke(app, ["preview-data", *args(tok, path, "data.on_bad_record=skip")])
    assert skipped.exit_code == 0 and "1 of 1 samples" in skipped.output


def test_preview_of_preference_pairs_shows_both_rows_with_only_the_answers_trained(tmp_path, tok):
    from preference_fixtures import write_pairs

    folder = write_pairs(tmp_path / "data", 4)
    records = json.loads((folder / "pairs.json").read_text())
    common = ["-c", str(TINY), "data.source=sft", f"data.dataset_dir={folder}", "data.dataset=pairs"]
    common += [f"data.tokenizer={tok}", "training.objective=dpo"]
    text = CliRunner().invoke(app, ["preview-data", *common, "--first", "1"])
    assert text.exit_code == 0, text.output
    assert "sample 0  chosen" in text.output and "sample 0  rejected" in text.output
    assert f"[[{records[0]['chosen']['value']}<|im_end|>" in text.output
    assert f"[[{records[0]['rejected']['value']}<|im_end|>" in text.output
    lines = CliRunner().invoke(app, ["preview-data", *common, "--first", "2", "--json"]).output.splitlines()
    first = json.loads(lines[0])
    assert first["index"] == 0 and set(first) == {"index", "chosen", "rejected"}
    chosen, rejected = first["chosen"], first["rejected"]
    prompt = next(i for i, t in enumerate(chosen["labels"]) if t != -100)
    assert chosen["input_ids"][:prompt] == rejected["input_ids"][:prompt], "one prompt, two answers"
    assert chosen["labels"][prompt:] == chosen["input_ids"][prompt:]
