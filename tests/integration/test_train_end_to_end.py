"""End to end: 2 Ray actors hosting DeepSpeed ZeRO-3 engines train a real HF causal LM; the run, stopped
and resumed with `elastictrain resume` past a corrupted checkpoint, matches the uninterrupted one;
offloaded runs train too. The commands that read a finished run (status, runs, verify, reshard, export,
training again) read this module's, so the command line's tests start no run of their own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import REPO, at_step, chain, interrupt_after, offload_overrides, record_losses, run, tiny_config
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from elastictrain.checkpoint.store import verify_checkpoint
from elastictrain.checkpoint.zero_state import FragmentReader
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


def test_resume_past_a_corrupted_checkpoint_falls_back_says_so_everywhere_and_matches_an_uninterrupted_run(
    finished_run, tmp_path
):
    """Stopped after step 10, its newest checkpoint (step 8) corrupted by one flipped byte: `resume`
    rejects it, says so in its output, the events and MLflow, loads step 4, and from there trains what
    the uninterrupted run trained, into the same MLflow run, each step logged once."""
    ref_dir = finished_run  # the same config but its tracking server: the uninterrupted run
    cfg = tiny_config(tmp_path / "stopped")
    with pytest.raises(KeyboardInterrupt):
        run(cfg, hook=interrupt_after(10))
    stopped = RunDir.open(tmp_path / "stopped")
    assert stopped.read_info().status == "STOPPED"
    mlflow_run = stopped.read_info().mlflow_run_id
    victim = stopped.checkpoints_dir / "step-000008" / "rank-00000-of-00002.safetensors"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different content
    victim.write_bytes(bytes(data))

    result = CliRunner().invoke(app, ["resume", str(tmp_path / "stopped")])
    assert result.exit_code == 0, result.output
    assert "step-000008 does not verify" in result.output and str(victim) in result.output, result.output
    info = stopped.read_info()
    assert info.status == "FINISHED" and info.last_step == 12
    assert info.mlflow_run_id == mlflow_run  # the same MLflow run across the restart
    events = stopped.read_events()
    rejected = [e for e in events if e["event"] == "checkpoint_rejected"]
    assert len(rejected) == 1 and str(victim) in rejected[0]["problems"][0]
    resumes = [e["tag"] for e in events if e["event"] == "resume"]
    assert resumes[0] == "step-000008" and resumes[-1] == "step-000004", resumes  # the newest, then back
    attempt = [e for e in events if e["event"] == "attempt_started"][-1]
    assert attempt["checkpoint"] == "step-000004"
    assert attempt["verify_s"] >= 0 and attempt["load_s"] > 0  # verification timed beside the load
    client = MlflowClient(resolve_tracking_uri(info.mlflow_tracking_uri, stopped.path))
    local = client.download_artifacts(info.mlflow_run_id, "events.jsonl", str(tmp_path / "dl"))
    assert any(
        json.loads(line)["event"] == "checkpoint_rejected" for line in Path(local).read_text().splitlines()
    )
    # Steps 5-10 were trained twice; MLflow holds each step once.
    assert sorted(m.step for m in client.get_metric_history(info.mlflow_run_id, "loss")) == list(range(1, 13))

    # Same world size, same data order, exact fp32 state in the checkpoint: the trajectory after the
    # fallback is the uninterrupted one. Only summation order inside CPU kernels could differ, hence a
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


# -- the command line on the finished run: read-only, but the last test, which trains it again --
def test_status_and_runs_show_the_run(finished_run):
    finished_run = finished_run.path
    status = CliRunner().invoke(app, ["status", str(finished_run)])
    assert status.exit_code == 0, status.output
    assert "FINISHED" in status.output and "step-000012" in status.output and "2 from step 0" in status.output
    runs = CliRunner().invoke(app, ["runs", str(finished_run.parent)])
    assert "FINISHED" in runs.output and str(finished_run) in runs.output


def test_verify_names_a_corrupted_file(finished_run, tmp_path):
    finished_run = finished_run.path
    import shutil

    ok = CliRunner().invoke(app, ["verify", str(finished_run)])
    assert ok.exit_code == 0 and "every file matches" in ok.output
    copy = tmp_path / "ck"
    shutil.copytree(finished_run / "checkpoints" / "step-000012", copy)
    victim = copy / "rank-00001-of-00002.safetensors"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    bad = CliRunner().invoke(app, ["verify", str(copy)])
    assert bad.exit_code == 1 and "rank-00001-of-00002.safetensors: sha256 differs" in bad.output


def test_reshard_writes_an_equivalent_checkpoint_for_another_world_size(finished_run, tmp_path):
    finished_run = finished_run.path
    result = CliRunner().invoke(
        app, ["reshard", str(finished_run), "--world-size", "3", "--out", str(tmp_path / "ws3")]
    )
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "ws3" / "manifest.json").read_text())
    assert manifest["world_size"] == 3 and len(manifest["files"]) == 3
    original = FragmentReader(sorted((finished_run / "checkpoints" / "step-000012").glob("*.safetensors")))
    resharded = FragmentReader(sorted((tmp_path / "ws3").glob("*.safetensors")))
    for name in original.params:
        assert original.fields(name) == resharded.fields(name) == ["fp32", "exp_avg", "exp_avg_sq"]
        for field in original.fields(name):
            assert torch.equal(original.full(name, field), resharded.full(name, field))
    assert CliRunner().invoke(app, ["verify", str(tmp_path / "ws3")]).exit_code == 0


def test_export_loads_with_from_pretrained_and_holds_the_trained_weights(finished_run, tmp_path):
    finished_run = finished_run.path
    from transformers import AutoModelForCausalLM

    result = CliRunner().invoke(app, ["export", str(finished_run), "--out", str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    reader = FragmentReader(sorted((finished_run / "checkpoints" / "step-000012").glob("*.safetensors")))
    params = dict(model.named_parameters())
    assert set(params) == set(reader.params)
    for name, p in params.items():
        assert torch.equal(p.detach(), reader.full(name)), name
    tokens = torch.tensor([list(b"The fox sees")])
    assert torch.isfinite(model(input_ids=tokens).logits).all()


def test_training_again_in_the_same_folder_continues_it_and_another_config_is_refused(finished_run):
    finished_run = finished_run.path
    # The run's config.yaml is its resolved config: training with it again targets the same folder.
    same_config = str(finished_run / "config.yaml")
    same = CliRunner().invoke(app, ["train", "-c", same_config])
    assert same.exit_code == 0, same.output
    assert "already holds this run: continuing it" in same.output
    other = CliRunner().invoke(app, ["train", "-c", same_config, "training.lr=0.01"])
    assert other.exit_code == 2 and "--fresh" in other.output and "another config" in other.output
