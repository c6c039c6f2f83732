"""The command line as a user meets it: config printing, errors, status, verify, reshard, export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import TINY, run, tiny_config
from typer.testing import CliRunner

from elastictrain.checkpoint.zero_state import FragmentReader
from elastictrain.cli import app

pytestmark = pytest.mark.integration
cli = CliRunner()


def test_print_config_shows_the_resolved_config_and_starts_nothing(tmp_path):
    result = cli.invoke(
        app, ["train", "-c", str(TINY), "--print-config", f"run.dir={tmp_path}/r", "training.max_steps=7"]
    )
    assert result.exit_code == 0, result.output
    assert "max_steps: 7" in result.output and f"dir: {tmp_path}/r" in result.output
    assert not (tmp_path / "r").exists()


def test_bad_config_is_refused_before_any_run_folder_or_actor_exists(tmp_path):
    result = cli.invoke(
        app,
        ["train", "-c", str(TINY), f"run.dir={tmp_path}/r", "scaling.min_workers=3", "training.max_stepz=1"],
    )
    assert result.exit_code == 2
    assert "unknown key 'training.max_stepz'; did you mean 'training.max_steps'?" in result.output
    assert not (tmp_path / "r").exists()
    missing = cli.invoke(app, ["train", "-c", str(tmp_path / "nope.yaml")])
    assert missing.exit_code == 2 and "does not exist" in missing.output


def test_resume_and_status_of_a_folder_that_is_not_a_run(tmp_path):
    for command in (["resume", str(tmp_path)], ["status", str(tmp_path)]):
        result = cli.invoke(app, command)
        assert result.exit_code == 2 and "not an elastictrain run folder" in result.output


@pytest.fixture(scope="module")
def finished_run(ray_local, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli-run")
    summary, run_dir, out = run(tiny_config(root / "run", "training.max_steps=4"))
    assert summary.status.value == "FINISHED", out
    return run_dir.path


def test_status_and_runs_show_the_run(finished_run):
    status = cli.invoke(app, ["status", str(finished_run)])
    assert status.exit_code == 0, status.output
    assert "FINISHED" in status.output and "step-000004" in status.output and "2 from step 0" in status.output
    runs = cli.invoke(app, ["runs", str(finished_run.parent)])
    assert "FINISHED" in runs.output and str(finished_run) in runs.output


def test_training_again_in_the_same_folder_continues_it_and_another_config_is_refused(finished_run):
    # The run's config.yaml is its resolved config: training with it again targets the same folder.
    same_config = str(finished_run / "config.yaml")
    same = cli.invoke(app, ["train", "-c", same_config])
    assert same.exit_code == 0, same.output
    assert "already holds this run: continuing it" in same.output
    other = cli.invoke(app, ["train", "-c", same_config, "training.lr=0.01"])
    assert other.exit_code == 2 and "--fresh" in other.output and "another config" in other.output


def test_verify_names_a_corrupted_file(finished_run, tmp_path):
    import shutil

    ok = cli.invoke(app, ["verify", str(finished_run)])
    assert ok.exit_code == 0 and "every file matches" in ok.output
    copy = tmp_path / "ck"
    shutil.copytree(finished_run / "checkpoints" / "step-000004", copy)
    victim = copy / "rank-00001-of-00002.safetensors"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    bad = cli.invoke(app, ["verify", str(copy)])
    assert bad.exit_code == 1 and "rank-00001-of-00002.safetensors: sha256 differs" in bad.output


def test_reshard_writes_an_equivalent_checkpoint_for_another_world_size(finished_run, tmp_path):
    result = cli.invoke(
        app, ["reshard", str(finished_run), "--world-size", "3", "--out", str(tmp_path / "ws3")]
    )
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "ws3" / "manifest.json").read_text())
    assert manifest["world_size"] == 3 and len(manifest["files"]) == 3
    original = FragmentReader(sorted((finished_run / "checkpoints" / "step-000004").glob("*.safetensors")))
    resharded = FragmentReader(sorted((tmp_path / "ws3").glob("*.safetensors")))
    for name in original.params:
        assert original.fields(name) == resharded.fields(name) == ["fp32", "exp_avg", "exp_avg_sq"]
        for field in original.fields(name):
            assert torch.equal(original.full(name, field), resharded.full(name, field))
    assert cli.invoke(app, ["verify", str(tmp_path / "ws3")]).exit_code == 0


def test_export_loads_with_from_pretrained_and_holds_the_trained_weights(finished_run, tmp_path):
    from transformers import AutoModelForCausalLM

    result = cli.invoke(app, ["export", str(finished_run), "--out", str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    reader = FragmentReader(sorted((finished_run / "checkpoints" / "step-000004").glob("*.safetensors")))
    params = dict(model.named_parameters())
    assert set(params) == set(reader.params)
    for name, p in params.items():
        assert torch.equal(p.detach(), reader.full(name)), name
    tokens = torch.tensor([list(b"The fox sees")])
    assert torch.isfinite(model(input_ids=tokens).logits).all()
