"""Issue 12 point 10: one masking function on every path to disk, MLflow and the terminal: a worker's
error quoting a secret, the URL forms a secret takes, log tracebacks and uncaught exceptions."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from loop_harness import TINY, Clock

from elastictrain.redact import MASK, install_log_redaction, redact_text

ENV_TOKEN = "hf_worker_secret_123456"
URL_PASSWORD = "pa/ss@w0rd"  # '/' and '@' inside a password


@pytest.mark.parametrize(
    ("text", "masked"),
    [
        ("https://ghp_abcdef123456@github.com/o/r.git", f"https://{MASK}@github.com/o/r.git"),
        (f"http://alice:{URL_PASSWORD}@mlflow:5000/api", f"http://alice:{MASK}@mlflow:5000/api"),
        ("postgresql://u:p4ss@db/x", f"postgresql://u:{MASK}@db/x"),
        ("s3://b/k?X-Amz-Signature=abc123&x=1", f"s3://b/k?X-Amz-Signature={MASK}&x=1"),
        ("see http://host/path?mail=a@b.com", "see http://host/path?mail=a@b.com"),  # no userinfo
        ('{"u":"http://host","mail":"a@b.com"}', '{"u":"http://host","mail":"a@b.com"}'),  # JSON stays JSON
    ],
)
def test_every_url_form_of_a_secret_is_masked(text: str, masked: str) -> None:
    assert redact_text(text) == masked


def test_a_worker_error_quoting_a_secret_is_masked_in_events_run_json_mlflow_and_the_terminal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    from mlflow.tracking import MlflowClient

    from elastictrain.config import config_digest, load_config, to_yaml
    from elastictrain.control.loop import Controller
    from elastictrain.control.progress import Reporter
    from elastictrain.rundir.run_dir import RunDir
    from elastictrain.testing.fake_group import FakeGroup
    from elastictrain.tracking.run_tracker import run_tracker
    from elastictrain.tracking.tracker import default_tracking_uri

    monkeypatch.setenv("HF_TOKEN", ENV_TOKEN)
    cfg = load_config(
        TINY,
        [
            f"run.dir={tmp_path}/run",
            "training.max_steps=12",
            "checkpoint.every_steps=4",
            "scaling.min_workers=1",
        ],
    )
    rd = RunDir.create(tmp_path / "run", name="s", config_yaml=to_yaml(cfg), config_digest=config_digest(cfg))
    uri = default_tracking_uri(rd.path)
    tracker = run_tracker(rd, uri, "secrets", start_wait_s=60.0)
    tracker.start()
    group = FakeGroup(2)
    # A worker's error names its token twice, and a URL with a password: the same error twice stops the run.
    error = (
        f"OSError: 401 Client Error for https://{ENV_TOKEN}@huggingface.co/m (token={ENV_TOKEN}); "
        f"mirror http://bob:{URL_PASSWORD}@mirror.local/m"
    )
    group.raise_at_step(rank=0, step=6, error=error)
    group.raise_at_step(rank=0, step=6, error=error)
    terminal = io.StringIO()
    reporter = Reporter(cfg.training.max_steps, stream=terminal, live=False)
    try:
        summary = Controller(cfg, rd, tracker, reporter, group, clock=Clock()).run()
        tracker.finish(summary.status.value)
    finally:
        tracker.close()
    assert summary.status.value == "FAILED" and "401 Client Error" in rd.read_info().message

    def assert_masked(text: str, where: str) -> None:
        assert ENV_TOKEN not in text and URL_PASSWORD not in text, where

    assert_masked(rd.run_json.read_text(), "run.json")
    events = rd.events_path.read_text()
    assert_masked(events, "events.jsonl")
    assert f"https://{MASK}@huggingface.co" in events and f"http://bob:{MASK}@mirror.local" in events
    assert_masked(terminal.getvalue(), "the terminal")
    assert "401 Client Error" in terminal.getvalue()
    for path in (rd.path / "tracking-spool").rglob("*"):
        assert_masked(path.read_text(), str(path))
    client = MlflowClient(uri)
    run = client.get_run(str(rd.read_info().mlflow_run_id))
    assert_masked(json.dumps(run.data.tags), "MLflow tags (last_event)")
    artifact = client.download_artifacts(run.info.run_id, "events.jsonl", str(tmp_path / "dl"))
    assert_masked(Path(artifact).read_text(), "MLflow's events.jsonl")
    assert "401 Client Error" in Path(artifact).read_text()


def test_a_logged_traceback_is_masked(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    install_log_redaction()
    monkeypatch.setenv("HF_TOKEN", ENV_TOKEN)
    caplog.set_level(logging.INFO)
    try:
        raise RuntimeError(f"download failed with token {ENV_TOKEN}")
    except RuntimeError:
        logging.getLogger("anything").exception("it failed")
    assert ENV_TOKEN not in caplog.text
    assert f"RuntimeError: download failed with token {MASK}" in caplog.text


UNCAUGHT = textwrap.dedent(
    """
    import threading
    from elastictrain.redact import install_exception_redaction
    install_exception_redaction()
    def fail():
        raise RuntimeError("thread saw https://user:{pw}@host and {token}")
    t = threading.Thread(target=fail, name="worker-thread")
    t.start()
    t.join()
    raise RuntimeError("main saw {token}")
    """
)


def test_uncaught_exceptions_print_their_traceback_masked() -> None:
    code = UNCAUGHT.format(pw=URL_PASSWORD, token=ENV_TOKEN)
    env = {"HF_TOKEN": ENV_TOKEN, "PYTHONPATH": ":".join(sys.path)}
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert child.returncode == 1
    assert ENV_TOKEN not in child.stderr and URL_PASSWORD not in child.stderr, child.stderr
    assert "Exception in thread worker-thread" in child.stderr
    assert f"https://user:{MASK}@host and {MASK}" in child.stderr
    assert f"RuntimeError: main saw {MASK}" in child.stderr
