"""MlflowTracker against real MLflow: an embedded SQLite store, a real `mlflow server`, and no server."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import _validate_metric_name

from elastictrain.tracking.mlflow_tracker import MlflowTracker
from elastictrain.tracking.tracker import default_tracking_uri, sanitize_key

pytestmark = pytest.mark.integration

CONFIG_YAML = "model:\n  name: tiny\noptim:\n  lr: 0.001\n"
PARAMS: dict[str, Any] = {
    "model.name": "tiny",
    "model.layers": 2,
    "optim.lr": 1e-3,
    "scaling.min_workers": 1,
    "run.dir": None,
    "data.note": "x" * 7000,  # longer than MLflow's param limit: truncated, not refused
    "bad key:with=chars": True,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def read_text_artifact(client: MlflowClient, run_id: str, path: str, tmp: Path) -> str:
    tmp.mkdir(parents=True, exist_ok=True)
    return Path(client.download_artifacts(run_id, path, str(tmp))).read_text()


def loss(step: int) -> float:
    return 10.0 / step


def log_session(tracker: MlflowTracker, steps: range, events: list[dict[str, Any]]) -> None:
    for step in steps:
        tracker.log_metrics({"loss": loss(step), "lr": 1e-3, "tokens/s": 100.0 * step}, step=step)
    for e in events:
        tracker.log_event(e)


def check_first_session(uri: str, run_id: str, tmp: Path, events: list[dict[str, Any]]) -> MlflowClient:
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "demo"
    params = run.data.params
    assert params["model.name"] == "tiny" and params["model.layers"] == "2" and params["optim.lr"] == "0.001"
    assert params["run.dir"] == "None"
    assert params["data.note"] == "x" * 6000
    assert params[sanitize_key("bad key:with=chars")] == "True"
    assert run.data.tags["elastictrain.run"] == "demo"
    assert run.data.tags["elastictrain.run_id"] == "abc"
    history = client.get_metric_history(run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, 21)), "every step exactly once"
    assert all(m.value == pytest.approx(loss(m.step)) for m in history)
    assert len(client.get_metric_history(run_id, "tokens/s")) == 20
    assert read_text_artifact(client, run_id, "config.yaml", tmp / "a") == CONFIG_YAML
    lines = read_text_artifact(client, run_id, "events.jsonl", tmp / "b").splitlines()
    assert [json.loads(x) for x in lines] == events
    assert json.loads(run.data.tags["last_event"]) == events[-1]
    return client


def first_session(uri: str, experiment: str, spool: Path) -> tuple[str, list[dict[str, Any]]]:
    tracker = MlflowTracker(
        uri,
        experiment,
        run_name="demo",
        spool_dir=spool,
        flush_interval_s=0.2,
        tags={"elastictrain.run_id": "abc"},
        start_wait_s=60.0,  # the run id is known once start() returns
    )
    events = [
        {"time": "2026-01-01T00:00:00+00:00", "event": "start", "step": 0, "message": "starting"},
        {"time": "2026-01-01T00:00:05+00:00", "event": "resize", "step": 10, "world_size": 3},
    ]
    try:
        run_id = tracker.start()
        assert run_id and tracker.run_id == run_id
        tracker.log_params(PARAMS)
        tracker.log_artifact_text(CONFIG_YAML, "config.yaml")
        log_session(tracker, range(1, 21), events)
        tracker.finish("FINISHED")
        assert tracker.pending_metrics == 0
    finally:
        tracker.close()
    return run_id, events


def test_embedded_sqlite_store(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    uri = default_tracking_uri(run_dir)
    assert uri == f"sqlite:///{run_dir.resolve()}/mlflow.db"
    run_id, events = first_session(uri, "elastictrain", run_dir)
    check_first_session(uri, run_id, tmp_path / "dl", events)
    # The default store keeps everything, artifacts included, inside the run folder.
    assert (run_dir / "mlflow.db").is_file()
    assert list((run_dir / "mlartifacts").rglob("config.yaml"))


def test_resume_appends_to_the_same_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    uri = default_tracking_uri(run_dir)
    run_id, events = first_session(uri, "elastictrain", run_dir)

    tracker = MlflowTracker(
        uri, "elastictrain", run_name="demo", spool_dir=run_dir, run_id=run_id, flush_interval_s=0.2
    )
    more = [{"time": "2026-01-01T01:00:00+00:00", "event": "resume", "step": 20}]
    try:
        assert tracker.start() == run_id
        client = MlflowClient(uri)
        assert client.get_run(run_id).info.status == "RUNNING"
        # The same params again (as a restarted driver would log them), and one that changed.
        tracker.log_params({**PARAMS, "optim.lr": 2e-3})
        log_session(tracker, range(21, 31), more)
        tracker.finish("FINISHED")
    finally:
        tracker.close()

    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["optim.lr"] == "0.001", "a logged param is never changed"
    assert run.data.tags["param_changed.optim.lr"] == "0.002"
    assert run.data.tags["elastictrain.resumes"] == "1"
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == list(range(1, 31))
    lines = read_text_artifact(client, run_id, "events.jsonl", tmp_path / "dl").splitlines()
    assert [json.loads(x) for x in lines] == events + more, "earlier sessions' events are kept"
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_real_mlflow_server(mlflow_server: str, tmp_path: Path) -> None:
    run_id, events = first_session(mlflow_server, "elastictrain-server", tmp_path)
    check_first_session(mlflow_server, run_id, tmp_path / "dl", events)


def test_resume_through_the_server(mlflow_server: str, tmp_path: Path) -> None:
    run_id, _ = first_session(mlflow_server, "elastictrain-server-resume", tmp_path)
    tracker = MlflowTracker(
        mlflow_server, "ignored-on-resume", run_name="demo", spool_dir=tmp_path, run_id=run_id
    )
    try:
        tracker.start()
        tracker.log_params(PARAMS)
        log_session(tracker, range(21, 31), [])
        tracker.finish("KILLED")
    finally:
        tracker.close()
    client = MlflowClient(mlflow_server)
    assert client.get_run(run_id).info.status == "KILLED"
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == list(range(1, 31))


def test_unreachable_server_never_blocks_training(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    caplog.set_level(logging.DEBUG, logger="elastictrain.tracker")
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there

    # A new run does not wait for the store either: start() returns after start_wait_s, without a run
    # id yet; the thread creates the run when the store answers (test_mlflow_outage.py).
    new = MlflowTracker(uri, "exp", run_name="demo", spool_dir=tmp_path / "new", start_wait_s=0.5)
    try:
        t0 = time.monotonic()
        assert new.start() == ""
        assert time.monotonic() - t0 < 0.5 + 5
    finally:
        new.close()
    caplog.clear()  # what follows counts the resumed tracker's reports only

    # Resuming a known run id goes on without the store; the thread keeps trying in the background.
    tracker = MlflowTracker(
        uri, "exp", run_name="demo", spool_dir=tmp_path, run_id="0" * 32, flush_interval_s=0.1
    )
    try:
        assert tracker.start() == "0" * 32
        calls = 0
        for step in range(1000):
            tracker.log_metrics({"loss": 1.0, "lr": 0.1}, step=step)
            tracker.log_event({"event": "tick", "step": step})
            calls += 1
        assert calls == 1000
        assert tracker.flush(timeout_s=2) is False
        assert tracker.pending_metrics == 2000, "nothing is lost while the store is away"
        t0 = time.monotonic()
        tracker.finish("FINISHED", timeout_s=2)
        assert time.monotonic() - t0 < 2 + 10
    finally:
        tracker.close()
    failures = [r for r in caplog.records if "MLflow logging to" in r.getMessage()]
    assert len(failures) == 1, "a failing store is reported once, not on every attempt"


def test_data_logged_while_the_server_is_down_arrives_when_it_is_back(
    mlflow_server_factory: Callable[..., AbstractContextManager[str]],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    port = free_port()
    with mlflow_server_factory(tmp_path, port) as uri:
        run_id, _ = first_session(uri, "outage", tmp_path / "spool")
    # The driver restarts while the server is down: it resumes by run id and trains on.
    tracker = MlflowTracker(
        uri, "outage", run_name="demo", spool_dir=tmp_path / "spool", run_id=run_id, flush_interval_s=0.1
    )
    try:
        tracker.start()
        tracker.log_params(PARAMS)
        log_session(tracker, range(21, 31), [{"event": "resume", "step": 20}])
        assert tracker.flush(timeout_s=1) is False
        with mlflow_server_factory(tmp_path, port):
            assert tracker.flush(timeout_s=60) is True
            tracker.finish("FINISHED")
            # Reading back what arrived: the 2 s and no retries above are for the tracker's sends (done
            # now), and a server busy under a loaded suite once took longer than that to answer a read.
            monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")
            monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
            client = MlflowClient(uri)
            run = client.get_run(run_id)
            steps = [m.step for m in client.get_metric_history(run_id, "loss")]
    finally:
        tracker.close()
    assert run.info.status == "FINISHED"
    assert sorted(steps) == list(range(1, 31))
    assert json.loads(run.data.tags["last_event"]) == {"event": "resume", "step": 20}


def test_pending_metrics_are_bounded(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    uri = f"http://127.0.0.1:{free_port()}"
    tracker = MlflowTracker(
        uri,
        "exp",
        run_name="demo",
        spool_dir=tmp_path,
        run_id="0" * 32,
        max_pending_metrics=50,
        start_wait_s=0,
    )
    try:
        tracker.start()
        for step in range(100):
            tracker.log_metrics({"loss": 1.0}, step=step)
        assert tracker.pending_metrics == 50  # in memory; the rest waits in the spool, nothing dropped
        assert tracker.spooled == 100
        assert sum("the rest wait in" in r.getMessage() for r in caplog.records) == 1
    finally:
        tracker.close()


@pytest.mark.parametrize(
    "key",
    [
        "loss",
        "train/loss",
        "a:b",
        "grad norm (L2)",
        "/lead",
        "trail/",
        "a//b",
        "a/./b",
        "../x",
        "",
        "é" * 300,
    ],
)
def test_sanitized_keys_pass_mlflow_validation(key: str) -> None:
    clean = sanitize_key(key)
    _validate_metric_name(clean)
    assert len(clean) <= 250


def test_a_moved_run_folder_keeps_logging_into_its_own_embedded_store(tmp_path: Path) -> None:
    import shutil

    from elastictrain.config import load_config
    from elastictrain.driver.launch import make_tracker, prepare_run_dir
    from elastictrain.rundir.run_dir import RunDir

    tiny = Path(__file__).resolve().parents[2] / "conf" / "tiny-cpu.yaml"
    cfg = load_config(tiny, [f"run.dir={tmp_path}/old/run"])
    run_dir, _ = prepare_run_dir(cfg, fresh=False)
    tracker = make_tracker(cfg, run_dir)
    try:
        tracker.log_metrics({"loss": 1.0}, step=1)
        tracker.log_event({"event": "before_move", "step": 1})
        tracker.finish("KILLED")
    finally:
        tracker.close()
    assert "old" not in (run_dir.read_info().mlflow_tracking_uri or ""), "stored relative to the run folder"

    shutil.move(str(tmp_path / "old"), tmp_path / "new")
    moved = RunDir.open(tmp_path / "new" / "run")
    tracker = make_tracker(load_config(moved.config_yaml), moved)  # what `resume` builds
    try:
        tracker.log_metrics({"loss": 0.5}, step=2)
        tracker.log_event({"event": "after_move", "step": 2})
        tracker.finish("FINISHED")
    finally:
        tracker.close()
    assert not (tmp_path / "old").exists(), "nothing written at the old place"
    client = MlflowClient(default_tracking_uri(moved.path))
    run_id = moved.read_info().mlflow_run_id
    assert run_id
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1, 2]
    events = read_text_artifact(client, run_id, "events.jsonl", tmp_path / "dl")
    assert [json.loads(x)["event"] for x in events.splitlines()] == ["before_move", "after_move"]
    assert list((moved.path / "mlartifacts").rglob("events.jsonl"))
