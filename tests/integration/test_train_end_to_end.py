"""Issue 2 end to end: 2 Ray actors hosting DeepSpeed ZeRO-3 engines train a real HF causal LM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import at_step, chain, offload_overrides, record_losses, run, tiny_config
from mlflow.tracking import MlflowClient

from elastictrain.checkpoint.store import verify_checkpoint
from elastictrain.rundir.run_dir import RunDir
from elastictrain.tracking.tracker import resolve_tracking_uri

pytestmark = pytest.mark.integration


def _losses(run_dir: RunDir, key: str = "loss") -> dict[int, float]:
    """Per-step metric from the run's MLflow run; for steps logged twice (rolled back), the last one."""
    info = run_dir.read_info()
    history = MlflowClient(resolve_tracking_uri(info.mlflow_tracking_uri, run_dir.path)).get_metric_history(
        info.mlflow_run_id, key
    )
    out: dict[int, float] = {}
    for m in sorted(history, key=lambda m: m.timestamp):
        out[m.step] = m.value
    return out


def test_two_workers_train_and_leave_the_run_folder_as_specified(ray_local, tmp_path):
    cfg = tiny_config(tmp_path / "run")
    summary, run_dir, output = run(cfg)

    assert summary.status.value == "FINISHED", output
    info = run_dir.read_info()
    assert info.status == "FINISHED" and info.last_step == 12
    assert [h["world_size"] for h in info.world_size_history] == [2]
    assert info.mlflow_run_id and info.config_digest
    assert (run_dir.path / "config.yaml").read_text().startswith("run:")

    events = run_dir.read_events()
    names = [e["event"] for e in events]
    assert names[0] == "start" and names[-1] == "finish"
    assert names.count("checkpoint") == 3  # steps 4, 8, 12
    assert all("time" in e for e in events)

    # Committed checkpoints: keep_last=2, `latest` names the newest, manifests complete and verified.
    ckpts = run_dir.checkpoints_dir
    assert (ckpts / "latest").read_text().strip() == "step-000012"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-000008", "step-000012"]
    manifest = json.loads((ckpts / "step-000012" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["step"] == 12
    assert manifest["samples_consumed"] == 12 * 12
    assert {f["name"] for f in manifest["files"]} == {
        "rank-00000-of-00002.safetensors",
        "rank-00001-of-00002.safetensors",
    }
    assert all(len(f["sha256"]) == 64 and f["bytes"] > 0 for f in manifest["files"])
    assert manifest["engine_state"]["optimizer_step"] == 12
    assert verify_checkpoint(ckpts / "step-000012") == []

    # Loss goes down (a generated grammar corpus is very learnable).
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(1, 13))
    assert losses[12] < losses[1] - 0.5, losses

    # The MLflow run holds the flattened config, every step's metrics and the config artifact.
    client = MlflowClient(resolve_tracking_uri(info.mlflow_tracking_uri, run_dir.path))
    mlrun = client.get_run(info.mlflow_run_id)
    assert mlrun.data.params["training.global_batch_size"] == "12"
    assert mlrun.data.params["model.hf_config.model_type"] == "llama"
    for key in ("lr", "samples_per_s", "tokens_per_s", "world_size", "step_time_s"):
        assert key in mlrun.data.metrics, key
    assert sorted(_losses(run_dir, "checkpoint_time_s")) == [4, 8, 12]
    artifact = client.download_artifacts(info.mlflow_run_id, "config.yaml", str(tmp_path / "dl"))
    assert Path(artifact).read_text() == (run_dir.path / "config.yaml").read_text()
    assert mlrun.info.status == "FINISHED"


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_zero3_with_optimizer_and_parameters_offloaded(ray_local, tmp_path, offload):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    cfg = tiny_config(
        tmp_path / "run",
        "training.max_steps=8",
        *offload_overrides(offload, nvme),
    )
    swap_files: list[str] = []
    losses: list[float] = []
    hook = chain(
        record_losses(losses),
        at_step(2, lambda c: swap_files.extend(str(p) for p in nvme.rglob("*") if p.is_file())),
    )
    summary, run_dir, output = run(cfg, tracking=False, hook=hook)
    assert summary.status.value == "FINISHED", output
    checkpoints = [e for e in run_dir.read_events() if e["event"] == "checkpoint"]
    assert [e["tag"] for e in checkpoints] == ["step-000004", "step-000008"]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5, losses
    if offload == "nvme":
        # While training, DeepSpeed kept the parameters and optimizer state in swap files under nvme_path.
        assert any(f.endswith(".swp") for f in swap_files), swap_files


def test_metrics_params_and_config_reach_a_real_mlflow_server(ray_local, tmp_path, mlflow_server):
    cfg = tiny_config(
        tmp_path / "run",
        "training.max_steps=4",
        f"tracking.uri={mlflow_server}",
        "tracking.experiment=server-test",
    )
    summary, run_dir, output = run(cfg)
    assert summary.status.value == "FINISHED", output
    info = run_dir.read_info()
    assert info.mlflow_tracking_uri == mlflow_server
    client = MlflowClient(mlflow_server)
    mlrun = client.get_run(info.mlflow_run_id)
    assert mlrun.info.status == "FINISHED"
    assert mlrun.data.params["training.max_steps"] == "4"
    assert sorted(_losses(run_dir)) == [1, 2, 3, 4]
    assert client.get_experiment(mlrun.info.experiment_id).name == "server-test"
    artifact = client.download_artifacts(info.mlflow_run_id, "config.yaml", str(tmp_path / "dl"))
    assert Path(artifact).read_text() == (run_dir.path / "config.yaml").read_text()
