"""Validation and token shards in a real run: 2 Ray workers, one killed mid-run (restart at world size 1),
real MLflow, data from `elastictrain prepare-data` (several shards, a local tokenizer).

One run, several checks: it trains on the shards; plots at its end (files and MLflow artifacts),
MLflow system metrics, the exported model logged to the run; evaluations every 4 steps and at the end, each
recorded once (terminal, events.jsonl, MLflow, run.json, `elastictrain status`); `elastictrain eval`
of the checkpoints, in one process, gives what the run logged at 2 workers; the sample ledger holds
every training sample exactly once across the restart at another world size, and no held-out one.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import ray
from helpers import REPO, at_step, run, tiny_config
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from elastictrain.cli import app
from elastictrain.core.data_order import held_out
from elastictrain.tracking.tracker import resolve_tracking_uri

pytestmark = pytest.mark.integration


def test_a_run_on_token_shards_validates_on_schedule_through_a_restart_and_eval_reproduces_it(
    ray_local, tmp_path, monkeypatch
):
    import sys

    sys.path.insert(0, str(REPO / "examples" / "hf_causal_lm"))
    from prepare import build_tokenizer

    from elastictrain.tools.prepare_data import prepare_data

    sentences = REPO / "examples" / "data" / "sentences.jsonl"
    texts = [json.loads(line)["text"] for line in sentences.read_text().splitlines() if line.strip()]
    vocab = len(build_tokenizer(texts, tmp_path / "tok"))
    index = prepare_data(
        [sentences], tmp_path / "shards", str(tmp_path / "tok"), shard_tokens=4000, progress=False
    )
    assert len(index["shards"]) >= 3
    ledger = tmp_path / "ledger.jsonl"
    monkeypatch.setenv("ELASTICTRAIN_SAMPLE_LEDGER", str(ledger))
    cfg = tiny_config(
        tmp_path / "run",
        "data.source=tokens",
        f"data.path={tmp_path / 'shards'}",
        f"model.hf_config.vocab_size={vocab}",
        "scaling.min_workers=1",
        "scaling.max_workers=2",
        "checkpoint.keep_last=3",
        "eval.split=0.05",
        "eval.steps=2",
        "eval.every_steps=4",
        "tracking.plots=true",
        "tracking.system_metrics=true",
        "tracking.system_metrics_interval_s=1",
    )

    def kill_last(controller: Any) -> None:
        ray.kill(controller.active[-1].actor)

    summary, run_dir, output = run(cfg, hook=at_step(6, kill_last))
    assert summary.status.value == "FINISHED", output
    events = run_dir.read_events()
    assert any(e["event"] == "failure" for e in events), output
    evals = [e for e in events if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [4, 8, 12], output  # step 4's is not logged again after the restart
    assert all(e["eval_samples"] == 2 * 12 and e["eval_tokens"] == 24 * 63 for e in evals)
    assert "eval at step 12: loss" in output

    info = run_dir.read_info()
    client = MlflowClient(resolve_tracking_uri(info.mlflow_tracking_uri, run_dir.path))
    for key in ("eval_loss", "eval_perplexity", "eval_tokens"):
        history = client.get_metric_history(info.mlflow_run_id, key)
        assert sorted(m.step for m in history) == [4, 8, 12], key
    logged = {m.step: m.value for m in client.get_metric_history(info.mlflow_run_id, "eval_loss")}
    assert logged[12] < logged[4]  # it learns
    assert info.extra["last_eval"]["step"] == 12
    assert info.extra["best_eval"]["eval_loss"] == pytest.approx(min(logged.values()), rel=1e-5)

    cli = CliRunner()
    status = cli.invoke(app, ["status", str(run_dir.path)])
    assert status.exit_code == 0 and "last eval: step 12, loss" in status.output, status.output

    # Each checkpoint evaluated here at world size 1 gives what the run logged (at 2 workers).
    for step in (4, 12):
        res = cli.invoke(app, ["eval", str(run_dir.path), "--checkpoint", f"step-{step:06d}", "--json"])
        assert res.exit_code == 0, res.output
        found = json.loads(res.output.strip().splitlines()[-1])
        assert found["step"] == step and found["eval_tokens"] == 24 * 63
        assert found["eval_loss"] == pytest.approx(logged[step], rel=1e-5), (step, found, logged)
    bad = cli.invoke(app, ["eval", str(run_dir.path), "--checkpoint", "step-000005"])
    assert bad.exit_code == 2 and "committed checkpoints of" in bad.output

    # Plots made at the end: valid PNGs in the run folder and in the MLflow run; `plot` makes them again.
    names = ["loss.png", "lr.png", "throughput.png", "world_size.png"]
    for name in names:
        assert (run_dir.path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(f.path for f in client.list_artifacts(info.mlflow_run_id, "plots")) == [
        f"plots/{n}" for n in names
    ]
    (run_dir.path / "plots" / "loss.png").unlink()
    again = cli.invoke(app, ["plot", str(run_dir.path)])
    assert again.exit_code == 0 and (run_dir.path / "plots" / "loss.png").is_file(), again.output
    metrics = client.get_run(info.mlflow_run_id).data.metrics
    assert any(k.startswith("system/cpu_utilization") for k in metrics), sorted(metrics)
    exported = cli.invoke(
        app, ["export", str(run_dir.path), "--out", str(tmp_path / "hf"), "--log-to-mlflow"]
    )
    assert exported.exit_code == 0, exported.output
    model_files = {f.path for f in client.list_artifacts(info.mlflow_run_id, "model/step-000012")}
    assert {"model/step-000012/config.json", "model/step-000012/model.safetensors"} <= model_files

    held = set(held_out(index["tokens"] // 64, 0.05, cfg.training.seed)[1])
    trained = [i for line in ledger.read_text().splitlines() for i in json.loads(line)["ids"]]
    # Steps 5 and 6 are in the ledger twice (before the failure, and redone): 12 steps of 12 samples.
    assert len(set(trained)) == 12 * 12 and held and not held & set(trained)
