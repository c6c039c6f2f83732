"""`eval.prompts` in real runs: what the model says at each validation and at the end.

At 2 Ray workers under ZeRO-3 (every forward gathers the partitioned parameters, so both ranks generate
in lockstep), on generated data (the byte tokenizer), prompts taken from the validation set's first
records; and with --local on a pretrained model with its own tokenizer and chat template, prompts given
as strings. Each run: the `completions` events, the MLflow table (a real store in the run folder),
`elastictrain status`; the local one also `elastictrain eval` of a checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import REPO, quiet_reporter, run, tiny_config
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from elastictrain.cli import app
from elastictrain.tracking.tracker import resolve_tracking_uri

pytestmark = pytest.mark.integration


def logged_table(run_dir: Any) -> list[list[Any]]:
    """The MLflow table of the run's completions, read back as mlflow.load_table reads it (load_table
    itself searches the runs of the process-wide tracking URI, not this run folder's store)."""
    import pandas as pd

    info = run_dir.read_info()
    client = MlflowClient(resolve_tracking_uri(info.mlflow_tracking_uri, run_dir.path))
    run = client.get_run(info.mlflow_run_id)
    assert {"path": "eval_completions.json", "type": "table"} in json.loads(
        run.data.tags["mlflow.loggedArtifacts"]
    )
    local = client.download_artifacts(info.mlflow_run_id, "eval_completions.json", str(run_dir.path / "dl"))
    frame = pd.read_json(local, orient="split")
    return frame[["step", "prompt", "completion"]].values.tolist()


@pytest.mark.timeout(240)
def test_two_zero3_workers_say_the_same_thing_at_every_validation(ray_local, tmp_path):
    from elastictrain.data.eval_data import train_and_eval_datasets

    cfg = tiny_config(
        tmp_path / "run",
        "eval.split=0.05",
        "eval.steps=1",
        "eval.every_steps=4",
        "eval.prompts=2",
        "eval.max_new_tokens=12",
    )
    assert cfg.deepspeed.zero_stage == 3 and cfg.scaling.min_workers == 2
    summary, run_dir, output = run(cfg)
    assert summary.status.value == "FINISHED" and summary.world_sizes == [2], output

    # The prompts: the first half of the validation set's first 2 records (bytes), the rest the reference.
    _, held = train_and_eval_datasets(cfg)
    records = [bytes(held[i].tolist()).decode() for i in range(2)]
    said = [e for e in run_dir.read_events() if e["event"] == "completions"]
    assert [e["step"] for e in said] == [4, 8, 12], output  # every 4 steps and at the end
    for event in said:
        assert event["ranks_agree"] is True  # both ranks generated the same text
        assert [c["prompt"] + c["reference"] for c in event["completions"]] == records
        assert [len(c["prompt"]) for c in event["completions"]] == [32, 32]
        assert all(0 < len(c["completion"].encode()) <= 12 for c in event["completions"])
    assert "model at step 12: " in output

    last = said[-1]["completions"]
    assert logged_table(run_dir) == [
        [e["step"], c["prompt"], c["completion"]] for e in said for c in e["completions"]
    ]
    status = CliRunner().invoke(app, ["status", str(run_dir.path)])
    assert status.exit_code == 0, status.output
    shown = [f"  {json.dumps(c['prompt'])} -> {json.dumps(c['completion'])}" for c in last]
    assert "\n".join(["model says (step 12, greedy):", *shown]) in status.output, status.output


@pytest.mark.timeout(240)
def test_a_local_run_of_a_pretrained_model_answers_string_prompts_through_its_chat_template(tmp_path):
    from pretrained_models import make_pretrained
    from transformers import AutoTokenizer

    from elastictrain.driver.launch import prepare_run_dir, run_training

    # A Qwen2-style folder: its tokenizer has a chat template, and its generation_config.json asks for
    # sampling (do_sample, temperature), which validation's greedy completions must override.
    model = make_pretrained(tmp_path / "qwen2", "qwen2")
    tokenizer = AutoTokenizer.from_pretrained(model)
    assert tokenizer.chat_template and json.loads((model / "generation_config.json").read_text())["do_sample"]
    prompts = ["the quick brown fox", "a user asks and"]
    cfg = tiny_config(
        tmp_path / "run",
        f"model.pretrained={model}",
        "data.source=hf",
        f"data.path={REPO / 'examples' / 'data' / 'sentences.jsonl'}",
        f"data.tokenizer={model}",
        "data.seq_len=32",
        "training.max_steps=6",
        "training.global_batch_size=8",
        "training.micro_batch_size=4",
        "checkpoint.every_steps=3",
        "eval.split=0.1",
        "eval.steps=1",
        "eval.every_steps=3",
        f"eval.prompts={json.dumps(prompts)}",
        "eval.max_new_tokens=6",
    )
    run_dir, _ = prepare_run_dir(cfg, fresh=False)
    summary = run_training(cfg, run_dir, reporter=quiet_reporter(6), local=True)
    assert summary.status.value == "FINISHED"
    from transformers.integrations import is_deepspeed_zero3_enabled

    # The run loaded the folder under ZeRO-3 in this process; a model built here next is a plain one.
    assert not is_deepspeed_zero3_enabled()

    said = [e for e in run_dir.read_events() if e["event"] == "completions"]
    assert [e["step"] for e in said] == [3, 6]
    for event in said:
        assert [c["prompt"] for c in event["completions"]] == prompts and event["ranks_agree"]
        assert all(
            isinstance(c["completion"], str) and "<|im_end|>" not in c["completion"]
            for c in event["completions"]
        )
    assert logged_table(run_dir) == [
        [e["step"], c["prompt"], c["completion"]] for e in said for c in e["completions"]
    ]
    cli = CliRunner()
    status = cli.invoke(app, ["status", str(run_dir.path)])
    assert status.exit_code == 0 and "model says (step 6, greedy):" in status.output, status.output

    # `elastictrain eval` of the last checkpoint, in this process, says the same: greedy, not sampled.
    evaluated = cli.invoke(app, ["eval", str(run_dir.path), "--json"])
    assert evaluated.exit_code == 0, evaluated.output
    found = json.loads(evaluated.output.strip().splitlines()[-1])
    assert found["step"] == 6 and found["completions"] == said[-1]["completions"]


@pytest.mark.timeout(60)
def test_a_table_logged_while_mlflow_is_away_arrives_later_as_a_table(tmp_path):
    from elastictrain.tracking.mlflow_tracker import MlflowTracker
    from elastictrain.tracking.tracker import default_tracking_uri

    uri = default_tracking_uri(tmp_path)
    text = json.dumps({"columns": ["step", "prompt", "completion"], "data": [[4, "a", "b"]]})
    away = MlflowTracker(uri, "elastictrain", run_name="t", spool_dir=tmp_path)
    away.log_artifact_text(text, "eval_completions.json", table=True)  # never started: only spooled
    away.close()
    back = MlflowTracker(
        uri, "elastictrain", run_name="t", spool_dir=tmp_path, flush_interval_s=0.2, start_wait_s=60.0
    )
    try:
        back.start()
        back.finish("FINISHED")
    finally:
        back.close()
    run_id = back.run_id
    client = MlflowClient(uri)
    tags = client.get_run(run_id).data.tags
    assert json.loads(tags["mlflow.loggedArtifacts"]) == [{"path": "eval_completions.json", "type": "table"}]
    local = client.download_artifacts(run_id, "eval_completions.json", str(tmp_path / "dl"))
    assert Path(local).read_text() == text
