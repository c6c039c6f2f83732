"""Stop a run after a checkpoint, `elastictrain resume` it, and compare with an uninterrupted run."""

from __future__ import annotations

import pytest
from helpers import TINY, at_step, run, tiny_config
from test_train_end_to_end import _losses
from typer.testing import CliRunner

from elastictrain.cli import app
from elastictrain.rundir.run_dir import RunDir

pytestmark = pytest.mark.integration


def _interrupt_after(step: int):  # noqa: ANN202
    """A controller hook that stops the driver (as Ctrl-C would) once `step` steps are done."""

    def stop(controller) -> None:  # noqa: ANN001
        raise KeyboardInterrupt

    return at_step(step, stop)


def test_resume_continues_the_same_run_and_matches_an_uninterrupted_one(ray_local, tmp_path):
    reference, ref_dir, out = run(tiny_config(tmp_path / "ref"))
    assert reference.status.value == "FINISHED", out

    cfg = tiny_config(tmp_path / "stopped")
    with pytest.raises(KeyboardInterrupt):
        run(cfg, hook=_interrupt_after(10))  # last checkpoint at 8: steps 9 and 10 are redone
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
