"""Issue 12 point 6: which MLflow answers drop data, and the spool's bound during an outage."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException, RestException
from mlflow.protos.databricks_pb2 import ErrorCode

from elastictrain.config import ConfigError, load_config
from elastictrain.tracking.tracker import is_permanent


def rest_error(code: str) -> RestException:
    return RestException({"error_code": code, "message": "refused"})


@pytest.mark.parametrize(
    ("error", "dropped"),
    [
        (rest_error("INVALID_PARAMETER_VALUE"), True),
        (rest_error("BAD_REQUEST"), True),
        (rest_error("UNAUTHENTICATED"), False),  # 401: an expired token
        (rest_error("PERMISSION_DENIED"), False),  # 403: a rotated password, a revoked grant
        (rest_error("RESOURCE_DOES_NOT_EXIST"), False),  # 404
        (rest_error("REQUEST_LIMIT_EXCEEDED"), False),  # 429
        (rest_error("INTERNAL_ERROR"), False),  # 500
        (MlflowException("a proxy's 401 page", error_code=ErrorCode.Name(ErrorCode.UNAUTHENTICATED)), False),
        (ConnectionError("refused"), False),
    ],
)
def test_only_a_request_mlflow_rejects_as_invalid_is_dropped(error: BaseException, dropped: bool) -> None:
    assert is_permanent(error) is dropped


def test_the_spool_bound_is_validated() -> None:
    with pytest.raises(ConfigError, match=r"tracking.max_spool_mb: got 0"):
        load_config(None, ["tracking.max_spool_mb=0"])


def test_a_full_spool_warns_first_then_drops_new_metrics_and_keeps_events(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from elastictrain.tracking.mlflow_tracker import MlflowTracker

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")
    caplog.set_level(logging.WARNING, logger="elastictrain.tracker")
    limit_mb = 0.02  # about 21 KB; nothing listens on port 9: an outage from the start
    tracker = MlflowTracker(
        "http://127.0.0.1:9", "e", run_name="r", spool_dir=tmp_path, start_wait_s=0.0, max_spool_mb=limit_mb
    )
    try:
        tracker.start()
        for step in range(1, 501):
            tracker.log_metrics({"loss": 1.0 / step, "lr": 0.001}, step=step)
        tracker.log_event({"event": "checkpoint", "step": 500})
        limit = int(limit_mb * 2**20)
        assert limit <= tracker._spool.size < limit + 1000, (
            "bounded (the last metrics line and the event past it)"
        )
        assert tracker.metrics_dropped > 0
        records = tracker._spool.read()
        assert records[-1]["kind"] == "event", "events are still spooled when the spool is full"
        kept = [r["data"][0][3] for r in records if r["kind"] == "metrics"]
        assert kept == list(range(1, len(kept) + 1)), "the oldest metrics are kept, the newest dropped"
    finally:
        tracker.close()
    assert "80% full" in caplog.text
    assert (
        f"is full (tracking.max_spool_mb=0.02); metrics from step {len(kept) + 1} on are dropped"
        in caplog.text
    )


@pytest.mark.parametrize("uri", ["file:///tmp/mlruns", "/tmp/mlruns", "mlruns"])
def test_a_file_store_uri_is_refused_naming_what_works(uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(ConfigError, match=r"tracking.uri: got .*file store refuses to open.*sqlite:///"):
        load_config(None, [f"tracking.uri={uri}"])
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the user opted back in
    assert load_config(None, [f"tracking.uri={uri}"]).tracking.uri == uri


@pytest.mark.parametrize("uri", ["sqlite:///tmp/mlflow.db", "http://127.0.0.1:5000", "databricks"])
def test_a_database_or_server_uri_is_accepted(uri: str) -> None:
    assert load_config(None, [f"tracking.uri={uri}"]).tracking.uri == uri
