"""Issue 12 points 8, 17 and 19: the offline commands (export, verify, reshard, status, runs) on real
checkpoint files written here, without Ray or DeepSpeed: what they use, what they refuse, what they say.
"""

from __future__ import annotations

import functools
import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as save_safetensors
from typer.testing import CliRunner

from elastictrain.checkpoint.store import MANIFEST, CheckpointStore
from elastictrain.checkpoint.zero_state import FRAGMENTS_KEY, Fragment, fragments_metadata
from elastictrain.cli import app
from elastictrain.config import config_digest, load_config, to_yaml
from elastictrain.rundir.run_dir import RunDir
from elastictrain.storage.durable import write_bytes_durably

cli = CliRunner()
TINY = Path(__file__).resolve().parents[2] / "conf" / "tiny-cpu.yaml"


@functools.cache
def tiny_model_parameters() -> dict[str, tuple[int, ...]]:
    """The parameters of the default config's model (names, shapes): what `export` checks a checkpoint for."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = dict(load_config(None).model.hf_config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(hf.pop("model_type"), **hf))
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def real_checkpoint(root: Path, step: int) -> Path:
    """A committed one-rank checkpoint in elastictrain's fragment format (fp32 weights only)."""
    store = CheckpointStore(root)
    staging = store.begin(step)
    tensors, fragments = {}, {}
    for name, shape in tiny_model_parameters().items():
        numel = int(torch.tensor(shape).prod())
        tensors[f"{name}::fp32"] = torch.linspace(-0.1, 0.1, numel) + step / 1000
        fragments[name] = Fragment(0, numel, numel, shape)
    data = save_safetensors(
        tensors, metadata={FRAGMENTS_KEY: fragments_metadata(fragments), "rank": "0", "world_size": "1"}
    )
    name = "rank-00000-of-00001.safetensors"
    entry = {"name": name, "bytes": len(data), "sha256": write_bytes_durably(staging / name, data)}
    hf = dict(load_config(None).model.hf_config)
    return store.commit(step, staging, [entry], {"world_size": 1, "model": {"hf_config": hf}}).path


def run_with_checkpoints(tmp_path: Path, *steps: int) -> RunDir:
    cfg = load_config(TINY, [f"run.dir={tmp_path}/run"])
    rd = RunDir.create(tmp_path / "run", name="t", config_yaml=to_yaml(cfg), config_digest=config_digest(cfg))
    for step in steps:
        real_checkpoint(rd.checkpoints_dir, step)
    return rd


def invoke(args: list[str], code: int = 0) -> str:
    result = cli.invoke(app, args)
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    return result.output


# ----------------------------------------------------------- 17: a latest folder without manifest.json


@pytest.fixture
def run_missing_latest_manifest(tmp_path: Path) -> RunDir:
    rd = run_with_checkpoints(tmp_path, 4, 8, 12)
    (rd.checkpoints_dir / "step-000012" / MANIFEST).unlink()
    return rd


@pytest.mark.parametrize("command", ["verify", "export", "reshard"])
def test_commands_say_which_checkpoint_they_use_when_the_latest_has_no_manifest(
    run_missing_latest_manifest, tmp_path, command
):
    rd = run_missing_latest_manifest
    extra = {"verify": [], "export": ["--out", str(tmp_path / "hf")]}.get(
        command, ["--world-size", "2", "--out", str(tmp_path / "ws2")]
    )
    out = " ".join(invoke([command, str(rd.path), *extra]).split())
    assert "using step-000008, not a newer folder" in out
    assert "step-000012: not a committed checkpoint: it has no manifest.json" in out
    assert "(`latest` names it)" in out


def test_status_does_not_call_a_folder_without_manifest_the_latest(run_missing_latest_manifest):
    out = invoke(["status", str(run_missing_latest_manifest.path)])
    assert "checkpoints: step-000004, step-000008 (latest: step-000008)" in out
    assert "not used: step-000012: not a committed checkpoint: it has no manifest.json" in out
    assert "a resume loads step-000008" in out


def test_a_latest_with_an_unreadable_manifest_is_passed_over_by_name(tmp_path):
    rd = run_with_checkpoints(tmp_path, 4, 8)
    (rd.checkpoints_dir / "step-000008" / MANIFEST).write_text("{not json")
    out = " ".join(invoke(["verify", str(rd.path)]).split())
    assert (
        "using step-000004" in out
        and "step-000008: not a committed checkpoint: its manifest.json does not read" in out
    )
    status = invoke(["status", str(rd.path)])
    assert "checkpoints: step-000004 (latest: step-000004)" in status


def test_commands_on_a_healthy_run_say_nothing_extra(tmp_path):
    rd = run_with_checkpoints(tmp_path, 4, 8)
    out = invoke(["verify", str(rd.path)])
    assert "step-000008: every file matches" in out and "note:" not in out


# ---------------------------------------------------------------------- 8: reshard --out is never a run


def test_reshard_refuses_to_replace_a_run_folder(tmp_path):
    rd = run_with_checkpoints(tmp_path, 4)
    other = run_with_checkpoints(tmp_path / "other", 4)
    out = " ".join(
        invoke(["reshard", str(rd.path), "--world-size", "2", "--out", str(other.path)], 2).split()
    )
    assert f"--out: {other.path} is a non-empty folder that is not a resharded checkpoint" in out
    assert (other.path / "run.json").is_file() and (
        other.checkpoints_dir / "step-000004" / MANIFEST
    ).is_file()


def test_reshard_refuses_to_replace_a_training_checkpoint_or_its_source(tmp_path):
    rd = run_with_checkpoints(tmp_path, 4, 8)
    source = rd.checkpoints_dir / "step-000008"
    for target in (source, rd.checkpoints_dir / "step-000004", rd.checkpoints_dir):
        out = invoke(["reshard", str(source), "--world-size", "2", "--out", str(target)], 2)
        assert "--out" in out
    assert (rd.checkpoints_dir / "step-000004" / MANIFEST).is_file() and (source / MANIFEST).is_file()


def test_reshard_replaces_its_own_earlier_output_and_fills_an_empty_folder(tmp_path):
    rd = run_with_checkpoints(tmp_path, 4)
    target = tmp_path / "ws2"
    target.mkdir()
    invoke(["reshard", str(rd.path), "--world-size", "2", "--out", str(target)])
    invoke(["reshard", str(rd.path), "--world-size", "3", "--out", str(target)])
    assert sorted(p.name for p in target.glob("*.safetensors"))[-1] == "rank-00002-of-00003.safetensors"


# ------------------------------------------------------------------------------------ 19: smaller ones


def test_reshard_out_naming_a_file_is_refused_without_a_traceback(tmp_path):
    rd = run_with_checkpoints(tmp_path, 4)
    f = tmp_path / "file.txt"
    f.write_text("mine")
    out = " ".join(invoke(["reshard", str(rd.path), "--world-size", "2", "--out", str(f)], 2).split())
    assert f"--out: {f} is a file; expected a folder" in out
    assert f.read_text() == "mine"


def test_reshard_refuses_a_world_size_beyond_the_largest_parameter(tmp_path):
    rd = run_with_checkpoints(tmp_path, 4)
    out = " ".join(
        invoke(["reshard", str(rd.path), "--world-size", "100000", "--out", str(tmp_path / "x")], 2).split()
    )
    assert "--world-size: got 100000; expected 1 to 16384" in out and "lm_head.weight" in out
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".staging-*"))


def test_runs_on_a_missing_folder_fails(tmp_path):
    out = " ".join(invoke(["runs", str(tmp_path / "nope")], 2).split())
    assert f"{tmp_path / 'nope'} does not exist" in out


def test_config_option_given_a_directory_says_it_is_a_directory(tmp_path):
    out = " ".join(invoke(["train", "-c", str(tmp_path), "--print-config"], 2).split())
    assert f"--config: {tmp_path} is a directory; give a YAML file" in out


def test_an_empty_config_file_says_the_defaults_are_used(tmp_path, caplog):
    f = tmp_path / "empty.yaml"
    f.write_text("# nothing yet\n")
    with caplog.at_level("WARNING"):
        cfg = load_config(f)
    assert cfg == load_config(None)
    assert f"config file {f} is empty: using the built-in defaults" in caplog.text


def test_exported_weights_are_readable_like_normal_files(tmp_path):
    rd = run_with_checkpoints(tmp_path, 4)
    old = os.umask(0o022)
    try:
        invoke(["export", str(rd.path), "--out", str(tmp_path / "hf")])
    finally:
        os.umask(old)
    for name in ("model.safetensors", "config.json"):
        assert stat.S_IMODE((tmp_path / "hf" / name).stat().st_mode) == 0o644, name
