"""End to end: 2 Ray actors hosting DeepSpeed ZeRO-3 engines train a real HF causal LM; the run, stopped
and resumed with `elastictrain resume`, matches the uninterrupted one; offloaded runs train too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import REPO, at_step, chain, interrupt_after, offload_overrides, record_losses, run, tiny_config
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from elastictrain.checkpoint.store import verify_checkpoint
from elastictrain.cli import app
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


@pytest.fixture(scope="module")
def finished_run(ray_local, mlflow_server, tmp_path_factory):  # noqa: ANN001, ANN201
    """The tiny preset's 12 steps at 2 workers, tracked on a real MLflow server: the run the first tests
    read, and the uninterrupted run test_resume_... compares with."""
    cfg = tiny_config(
        tmp_path_factory.mktemp("finished") / "run",
        f"tracking.uri={mlflow_server}",
        "tracking.experiment=e2e",
    )
    summary, run_dir, output = run(cfg)
    assert summary.status.value == "FINISHED", output
    return run_dir


def test_two_workers_train_and_leave_the_run_folder_as_specified(finished_run, tmp_path):
    run_dir = finished_run
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


def test_metrics_params_and_config_reach_a_real_mlflow_server(finished_run, mlflow_server):
    info = finished_run.read_info()
    assert info.mlflow_tracking_uri == mlflow_server
    client = MlflowClient(mlflow_server)
    mlrun = client.get_run(info.mlflow_run_id)
    assert mlrun.info.status == "FINISHED"
    assert mlrun.data.params["training.max_steps"] == "12"
    assert client.get_experiment(mlrun.info.experiment_id).name == "e2e"


def test_resume_continues_the_same_run_and_matches_an_uninterrupted_one(finished_run, tmp_path):
    ref_dir = finished_run  # the same config but its tracking server: the uninterrupted run
    cfg = tiny_config(tmp_path / "stopped")
    with pytest.raises(KeyboardInterrupt):
        run(cfg, hook=interrupt_after(10))  # last checkpoint at 8: steps 9 and 10 are redone
    stopped = RunDir.open(tmp_path / "stopped")
    assert stopped.read_info().status == "STOPPED"
    mlflow_run = stopped.read_info().mlflow_run_id

    result = CliRunner().invoke(app, ["resume", str(tmp_path / "stopped")])
    assert result.exit_code == 0, result.output
    info = stopped.read_info()
    assert info.status == "FINISHED" and info.last_step == 12
    assert info.mlflow_run_id == mlflow_run  # the same MLflow run across the restart
    resume_events = [e for e in stopped.read_events() if e["event"] == "resume"]
    assert resume_events and resume_events[0]["tag"] == "step-000008"

    # Same world size, same data order, exact fp32 state in the checkpoint: the trajectory after the
    # resume is the uninterrupted one. Only summation order inside CPU kernels could differ, hence a
    # tolerance of 1e-5 relative instead of bitwise equality.
    ref, resumed = _losses(ref_dir), _losses(stopped)
    assert sorted(resumed) == list(range(1, 13))
    for step in range(1, 13):
        assert resumed[step] == pytest.approx(ref[step], rel=1e-5), (step, resumed[step], ref[step])


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_zero3_with_optimizer_and_parameters_offloaded(ray_local, tmp_path, offload):
    """On CPU through a Hugging Face-style DeepSpeed JSON (ZeRO-3, optimizer and parameters on the CPU,
    "auto" values) given unchanged: its config keys' translation is what test_reshard.py's [cpu] sets up;
    on NVMe through the config keys."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    if offload == "cpu":
        placement = [f"deepspeed.config_file={REPO / 'conf' / 'deepspeed' / 'hf-zero3-offload.json'}"]
    else:
        placement = offload_overrides(offload, nvme)
    cfg = tiny_config(tmp_path / "run", "training.max_steps=8", *placement)
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
