"""Issue 12 points 15 and 19 on the driver's launch path, without starting Ray: the CPUs a local
cluster gets, the refusal of a run folder of another config, the MLflow line of a fresh run.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from elastictrain.cluster import connect
from elastictrain.config import load_config
from elastictrain.control.progress import Reporter
from elastictrain.driver import launch, preflight
from elastictrain.driver.launch import RunFolderConflict, prepare_run_dir
from elastictrain.tracking.tracker import NullTracker

TINY = Path(__file__).resolve().parents[2] / "conf" / "tiny-cpu.yaml"


def config(tmp_path: Path, *overrides: str):  # noqa: ANN201
    return load_config(TINY, [f"run.dir={tmp_path}/run", *overrides])


def test_a_local_cluster_gets_the_machines_cpus_not_max_workers_worth(tmp_path, monkeypatch):
    import ray

    started: dict[str, Any] = {}
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: started.update(kw))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    note = connect.connect_ray(config(tmp_path, "scaling.max_workers=64"), None)
    assert started["address"] == "local" and started["num_cpus"] is None  # Ray counts the real CPUs
    assert note == (
        "started a local Ray cluster with 2 CPUs: room for 2 worker(s) of scaling.cpus_per_worker=1, not "
        "scaling.max_workers=64 (set ray.num_cpus to start more workers than this machine has CPUs)"
    )
    connect.connect_ray(config(tmp_path, "ray.num_cpus=8"), None)
    assert started["num_cpus"] == 8, "an explicit ray.num_cpus is still honoured"


def test_a_run_folder_of_another_config_is_refused_with_the_keys_that_differ(tmp_path):
    prepare_run_dir(config(tmp_path), fresh=False)
    with pytest.raises(RunFolderConflict) as e:
        prepare_run_dir(config(tmp_path, "training.lr=0.001", "scaling.max_workers=3"), fresh=False)
    text = str(e.value)
    assert "holds a run of another config (scaling.max_workers: run has 2, config has 3; " in text
    assert "training.lr: run has 0.003, config has 0.001)" in text
    assert "digest" not in text


def test_a_retried_train_of_a_finished_run_ends_at_once_without_checking_or_starting_anything(
    tmp_path, monkeypatch
):
    from typer.testing import CliRunner

    from elastictrain.cli import app

    args = ["train", "-c", str(TINY), f"run.dir={tmp_path}/run"]
    run_dir, _ = prepare_run_dir(config(tmp_path), fresh=False)
    run_dir.update(status="FINISHED", last_step=20)

    def must_not_run(*_: Any, **__: Any) -> None:
        raise AssertionError("a finished run's retry checked the model or started a run")

    monkeypatch.setattr(launch, "check_before_start", must_not_run)
    monkeypatch.setattr(launch, "run_training", must_not_run)
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0, again.output
    assert "already holds this run: continuing it" in again.output
    assert "the run already finished at step 20; nothing to do" in again.output
    # Of another config, it is refused as before (the checks come first, so they are let through here).
    monkeypatch.setattr(launch, "check_before_start", lambda cfg: None)
    other = CliRunner().invoke(app, [*args, "training.lr=0.001"])
    assert other.exit_code == 2 and "holds a run of another config (training.lr" in other.output


def test_a_fresh_run_says_when_its_mlflow_run_is_created(tmp_path, monkeypatch):
    import elastictrain.cluster.worker_group as worker_group
    import elastictrain.control.loop as loop

    cfg = config(tmp_path)
    run_dir, _ = prepare_run_dir(cfg, fresh=False)

    class Stop(Exception):
        pass

    class Controller:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def run(self) -> None:
            raise Stop

    monkeypatch.setattr(connect, "connect_ray", lambda *a: "connected")
    monkeypatch.setattr(preflight, "check_memory_on_nodes", lambda *a: None)  # no Ray cluster here
    monkeypatch.setattr(launch, "make_tracker", lambda *a: NullTracker())
    monkeypatch.setattr(worker_group, "WorkerGroup", lambda *a, **k: None)
    monkeypatch.setattr(loop, "Controller", Controller)
    stream = io.StringIO()
    with pytest.raises(Stop):
        launch.run_training(cfg, run_dir, reporter=Reporter(4, stream=stream, live=False))
    assert f"run folder {run_dir.path}; MLflow run: created when the tracker connects" in stream.getvalue()
    assert "MLflow run -" not in stream.getvalue()


def test_a_node_without_the_nvme_folder_ends_the_cli_with_the_message_not_a_traceback(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from elastictrain.cli import app
    from elastictrain.driver.preflight import PreflightError

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise PreflightError(
            "deepspeed.nvme_path: got '/nvme'; expected a folder every worker node can write"
        )

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(launch, "run_training", refuse)
    result = CliRunner().invoke(app, ["train", "-c", str(TINY), f"run.dir={tmp_path}/run", "--no-tracking"])
    assert result.exit_code == 2, (result.output, result.exception)
    assert "error: deepspeed.nvme_path: got '/nvme'; expected a folder every worker node" in result.output
    assert "Traceback" not in result.output
