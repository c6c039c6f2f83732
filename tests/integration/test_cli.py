"""The command line before any run: config printing and errors. The commands that read a run (status,
runs, verify, reshard, export, training again) read test_train_end_to_end.py's finished run."""

from __future__ import annotations

import pytest
from helpers import TINY
from typer.testing import CliRunner

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
