"""`elastictrain resume` with a larger max_steps extends a finished run; changes it cannot take are refused.

A run stopped mid-way and resumed is compared with the uninterrupted one in test_train_end_to_end.py
(whose finished run it reuses)."""

from __future__ import annotations

import pytest
from helpers import TINY
from typer.testing import CliRunner

from elastictrain.cli import app
from elastictrain.rundir.run_dir import RunDir

pytestmark = pytest.mark.integration


def test_resume_with_a_larger_max_steps_extends_a_finished_run_and_records_the_change(tmp_path):
    run_dir = tmp_path / "run"
    common = ["--local", "--no-tracking"]
    base = [f"run.dir={run_dir}", "training.max_steps=4", "training.warmup_steps=1"]
    base += ["checkpoint.every_steps=2", "data.generated_chars=60000"]
    cli = CliRunner()
    trained = cli.invoke(app, ["train", *common, "-c", str(TINY), *base])
    assert trained.exit_code == 0, trained.output
    rd = RunDir.open(run_dir)
    assert rd.read_info().status == "FINISHED" and rd.read_info().last_step == 4

    refused = cli.invoke(app, ["resume", str(run_dir), *common, "model.hf_config.hidden_size=128"])
    assert refused.exit_code != 0
    assert "model.hf_config.hidden_size: cannot change when resuming; it changes the model's shape" in (
        refused.output
    )
    shorter = cli.invoke(app, ["resume", str(run_dir), *common, "training.max_steps=3"])
    assert shorter.exit_code != 0 and "already trained 4 steps" in shorter.output

    extended = cli.invoke(app, ["resume", str(run_dir), *common, "training.max_steps=8"])
    assert extended.exit_code == 0, extended.output
    assert "config changed on resume: training.max_steps: 4 -> 8" in extended.output
    info = rd.read_info()
    assert info.status == "FINISHED" and info.last_step == 8
    assert "max_steps: 8" in rd.config_yaml.read_text()
    (change,) = [e for e in rd.read_events() if e["event"] == "config_changed"]
    assert change["changes"] == {"training.max_steps": {"from": 4, "to": 8}}
    resumed = [e for e in rd.read_events() if e["event"] == "resume"]
    assert resumed[-1]["tag"] == "step-000004"  # continued from the finished run's last checkpoint
