"""Issue 6.4: bad input gets a clear error (what is wrong, what would be valid), never a traceback or a
half-started run. Config value cases beyond these are in test_config.py (35 cases + DeepSpeed JSON).
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from elastictrain.checkpoint.store import CheckpointStore
from elastictrain.cli import app
from elastictrain.config import ConfigError, load_config
from elastictrain.storage.durable import write_bytes_durably

cli = CliRunner()
TINY = Path(__file__).resolve().parents[2] / "conf" / "tiny-cpu.yaml"


def problems(*overrides: str, path: Path | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    return str(e.value)


def refused(args: list[str], code: int = 2) -> str:
    """Run the CLI; it must exit with `code` and a message, not an exception's traceback."""
    result = cli.invoke(app, args)
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    return result.output


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fake_checkpoint(root: Path, step: int = 4, hidden: int = 64) -> Path:
    store = CheckpointStore(root)
    staging = store.begin(step)
    data = os.urandom(4096)
    name = "rank-00000-of-00001.safetensors"
    entry = {"name": name, "bytes": len(data), "sha256": write_bytes_durably(staging / name, data)}
    hf = {**load_config(None).model.hf_config, "hidden_size": hidden}
    return store.commit(step, staging, [entry], {"world_size": 1, "model": {"hf_config": hf}}).path


# ------------------------------------------------------------------ configs (beyond test_config.py)


def test_a_section_given_as_a_scalar():
    assert "scaling: got 3; expected a mapping of min_workers" in problems("scaling=3")


def test_a_float_where_an_integer_is_expected():
    assert "training.max_steps: got 1.5; expected an integer" in problems("training.max_steps=1.5")


def test_a_list_where_a_number_is_expected():
    assert "training.lr: got [1, 2]; expected a number" in problems("training.lr=[1,2]")


def test_negative_max_workers():
    assert "scaling.max_workers: got -1; expected a number >= 1" in problems("scaling.max_workers=-1")


def test_negative_wait_for_capacity():
    text = problems("failure.wait_for_capacity_s=-1")
    assert "failure.wait_for_capacity_s: got -1.0; expected a number >= 0" in text


def test_min_workers_above_max_workers_names_both():
    text = problems("scaling.min_workers=4", "scaling.max_workers=3")
    assert "scaling.min_workers: got 4; expected <= scaling.max_workers (3)" in text


def test_a_global_batch_that_no_world_size_in_range_splits():
    text = problems("training.global_batch_size=7", "scaling.min_workers=2", "scaling.max_workers=4")
    assert "training.global_batch_size: got 7" in text and "global batch sizes that work" in text


def test_an_unknown_section():
    assert "unknown key 'trainng'; did you mean 'training'?" in problems("trainng.lr=1")


def test_a_config_file_whose_top_level_is_a_list(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("- a\n- b\n")
    assert "expected a mapping of sections at the top level" in problems(path=f)


def test_an_nvme_path_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    text = problems("deepspeed.offload_optimizer=nvme", f"deepspeed.nvme_path={f}")
    assert f"deepspeed.nvme_path: got '{f}'; expected an existing folder" in text


def test_an_nvme_path_that_is_not_writable(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    mounted = (
        os.geteuid() == 0
        and subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)]).returncode == 0
    )
    if not mounted:
        folder.chmod(0o500)  # not root: permissions are enough (root ignores them, hence the ro mount)
    try:
        text = problems("deepspeed.offload_optimizer=nvme", f"deepspeed.nvme_path={folder}")
        assert f"deepspeed.nvme_path: got '{folder}'; expected a folder this user can write" in text
    finally:
        if mounted:
            subprocess.run(["umount", str(folder)], check=False)
        folder.chmod(0o700)


# ------------------------------------------------------------------ command-line arguments


def test_an_override_without_equals_sign_starts_nothing(tmp_path):
    out = refused(["train", "-c", str(TINY), f"run.dir={tmp_path}/r", "max_steps"])
    assert "override 'max_steps': expected key=value" in out
    assert not (tmp_path / "r").exists()


def test_an_unknown_option():
    assert "No such option" in refused(["train", "--max-steps", "3"])


def test_a_config_path_that_is_a_folder(tmp_path):
    assert "is a directory; give a YAML file" in refused(["train", "-c", str(tmp_path)])


def test_a_world_size_that_is_not_a_number(tmp_path):
    assert "Invalid value for '--world-size'" in refused(["reshard", str(tmp_path), "--world-size", "abc"])


def test_a_world_size_below_one(tmp_path):
    ck = fake_checkpoint(tmp_path / "checkpoints")
    out = refused(["reshard", str(ck), "--world-size", "0"])
    assert "--world-size: got 0; expected an integer >= 1" in out


def test_verify_of_a_path_without_a_checkpoint(tmp_path):
    out = refused(["verify", str(tmp_path / "nothing")])
    assert "no committed checkpoint here; expected a folder holding manifest.json" in out


def test_verify_of_a_manifest_that_is_not_json(tmp_path):
    ck = fake_checkpoint(tmp_path / "checkpoints")
    (ck / "manifest.json").write_text("{not json")
    out = refused(["verify", str(ck)], code=1)
    assert "manifest.json: unreadable or not a manifest" in out


def test_export_refuses_a_checkpoint_that_does_not_verify(tmp_path):
    ck = fake_checkpoint(tmp_path / "checkpoints")
    victim = ck / "rank-00000-of-00001.safetensors"
    victim.write_bytes(b"\0" * victim.stat().st_size)
    out = refused(["export", str(ck), "--out", str(tmp_path / "hf")], code=1)
    assert "does not verify, not exporting it" in out and "sha256 differs" in out
    assert not (tmp_path / "hf").exists()


def test_a_run_dir_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    assert "exists and is not a folder" in refused(["train", "-c", str(TINY), f"run.dir={f}"])


# ------------------------------------------------------------------ RUN_DIR that is not a run


@pytest.mark.parametrize("command", ["resume", "status", "sync"])
def test_a_folder_that_is_not_a_run(tmp_path, command):
    out = refused([command, str(tmp_path)])
    assert "is not an elastictrain run folder (no run.json)" in out and "elastictrain train" in out


def test_a_run_folder_with_a_corrupt_run_json(tmp_path):
    (tmp_path / "run.json").write_text("{broken")
    assert "run.json is corrupt" in refused(["resume", str(tmp_path)])


def test_a_run_dir_that_does_not_exist(tmp_path):
    assert "does not exist or is not a folder" in refused(["status", str(tmp_path / "missing")])


# ------------------------------------------------------------------ unreachable Ray address


def test_an_unreachable_ray_address_fails_at_once_and_creates_no_run_folder(tmp_path):
    port = free_port()  # nothing listens there
    out = refused(["train", "-c", str(TINY), f"run.dir={tmp_path}/r", "--address", f"127.0.0.1:{port}"])
    assert f"Ray address 127.0.0.1:{port}: no Ray cluster answers there" in out
    assert "ray start --head" in out
    assert not (tmp_path / "r").exists()


def test_a_malformed_ray_address(tmp_path):
    out = refused(["train", "-c", str(TINY), f"run.dir={tmp_path}/r", "ray.address=http://x"])
    assert "Ray address 'http://x': expected host:port" in out


# ------------------------------------------------------------------ a checkpoint from another model


class _NoCluster:
    """The controller must refuse before asking for any worker."""

    workers: list = []
    pending: list = []

    def shutdown(self) -> None:
        pass

    def __getattr__(self, name: str):  # noqa: ANN204
        raise AssertionError(f"the controller touched the cluster ({name}) before refusing")


def test_a_checkpoint_from_another_model_is_refused_naming_the_difference(tmp_path):
    from elastictrain.config import config_digest, to_yaml
    from elastictrain.control.loop import Controller
    from elastictrain.control.progress import Reporter
    from elastictrain.rundir.run_dir import RunDir
    from elastictrain.tracking.tracker import NullTracker

    cfg = load_config(TINY, [f"run.dir={tmp_path}/run"])
    rd = RunDir.create(tmp_path / "run", name="x", config_yaml=to_yaml(cfg), config_digest=config_digest(cfg))
    fake_checkpoint(rd.checkpoints_dir, hidden=32)  # e.g. copied from another run
    stream = io.StringIO()
    summary = Controller(cfg, rd, NullTracker(), Reporter(10, stream=stream, live=False), _NoCluster()).run()
    assert summary.status.value == "FAILED"
    assert "was saved from another model: model.hf_config.hidden_size: checkpoint has 32, config has 64" in (
        summary.message
    )
    assert "Resume it with the config it was trained with" in summary.message
    assert rd.read_info().status == "FAILED" and "another model" in stream.getvalue()
    assert json.loads(rd.run_json.read_text())["message"] == summary.message
