"""Issue 12 point 6: what MLflow refuses. A real `mlflow server` with MLflow's basic-auth app answers
401 to wrong credentials (a rotated password); only a request it rejects as invalid is dropped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from elastictrain.tracking.mlflow_tracker import MlflowTracker

pytestmark = pytest.mark.integration
ADMIN_PASSWORD = "right-password-4242"  # tests/conftest.py's mlflow_basic_auth_server


@pytest.fixture
def credentials(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", ADMIN_PASSWORD)
    return monkeypatch


def read_back_client(credentials: pytest.MonkeyPatch, uri: str) -> MlflowClient:
    """A client that reads what arrived, patient as a user would be: the short timeout and no retries
    above are for the tracker's sends, and a server busy with a loaded suite once took over 5 s."""
    credentials.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")
    credentials.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
    return MlflowClient(uri)


def tracker_for(uri: str, run_dir: Path, name: str) -> MlflowTracker:
    return MlflowTracker(
        uri, "refusals", run_name=name, spool_dir=run_dir, flush_interval_s=0.1, max_backoff_s=0.2,
        start_wait_s=30.0,
    )  # fmt: skip


def test_a_rotated_password_keeps_the_data_spooled_until_mlflow_takes_it(
    mlflow_basic_auth_server: str, credentials: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    tracker = tracker_for(mlflow_basic_auth_server, tmp_path, "rotated")
    try:
        run_id = tracker.start()
        assert run_id
        for step in range(1, 6):
            tracker.log_metrics({"loss": 1.0 / step}, step=step)
        assert tracker.flush(timeout_s=30)
        credentials.setenv("MLFLOW_TRACKING_PASSWORD", "the-old-password")  # every request now gets 401
        for step in range(6, 21):
            tracker.log_metrics({"loss": 1.0 / step}, step=step)
        tracker.log_event({"event": "checkpoint", "step": 20})
        # Many more 401 answers than the attempts after which an invalid request is dropped.
        assert tracker.flush(timeout_s=3) is False
        assert tracker._refused == {}, "a 401 is not counted as a rejection"
        assert tracker.spooled == 16, "the metrics and the event stay spooled"
        credentials.setenv("MLFLOW_TRACKING_PASSWORD", ADMIN_PASSWORD)  # the new password is given
        assert tracker.flush(timeout_s=30)
        assert tracker.spooled == 0
    finally:
        tracker.close()
    client = read_back_client(credentials, mlflow_basic_auth_server)
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == list(range(1, 21))
    assert json.loads(client.get_run(run_id).data.tags["last_event"])["step"] == 20
    assert not (tmp_path / "tracking-rejected.jsonl").exists()


def test_a_request_mlflow_rejects_as_invalid_is_dropped_and_recorded_in_the_run_folder(
    mlflow_basic_auth_server: str, credentials: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    tracker = tracker_for(mlflow_basic_auth_server, tmp_path, "invalid")
    try:
        run_id = tracker.start()
        assert run_id
        # Someone else logged this param first: MLflow refuses another value (400 INVALID_PARAMETER_VALUE).
        MlflowClient(mlflow_basic_auth_server).log_param(run_id, "lr", "0.1")
        tracker.log_params({"lr": 0.2})
        tracker.log_metrics({"loss": 1.0}, step=1)
        assert tracker.flush(timeout_s=30), "dropped after a few attempts; what follows goes out"
        assert tracker.spooled == 0
    finally:
        tracker.close()
    client = read_back_client(credentials, mlflow_basic_auth_server)
    assert client.get_run(run_id).data.params["lr"] == "0.1"
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1]
    [rejected] = [json.loads(x) for x in (tmp_path / "tracking-rejected.jsonl").read_text().splitlines()]
    assert rejected["what"] == "params"
    assert "INVALID_PARAMETER_VALUE" in rejected["error"] and "0.2" in rejected["data"]
