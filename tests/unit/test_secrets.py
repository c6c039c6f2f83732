"""Issue 6.6: secrets given in the config or the environment never land in MLflow params, config.yaml
or logs (a real embedded MLflow store; real log records)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from elastictrain.config import config_digest, load_config, to_flat_dict, to_yaml
from elastictrain.redact import MASK, install_log_redaction, is_secret_key, redact, redact_text

TINY = Path(__file__).resolve().parents[2] / "conf" / "tiny-cpu.yaml"
URL_PASSWORD = "hunter2-url-pass"
QUERY_TOKEN = "q-token-123456"
HF_TOKEN = "hf_cfg_secret_abcdef"
DS_KEY = "ds-api-key-987654"
SECRETS = (URL_PASSWORD, QUERY_TOKEN, HF_TOKEN, DS_KEY)


def config_with_secrets(tmp_path: Path, uri: str | None = None):  # noqa: ANN201
    uri = uri or f"http://alice:{URL_PASSWORD}@127.0.0.1:5000/?access_token={QUERY_TOKEN}"
    return load_config(
        TINY,
        [
            f"run.dir={tmp_path}/run",
            f"tracking.uri={uri}",
            f"model.hf_config.token={HF_TOKEN}",
            f"deepspeed.extra.api_key={DS_KEY}",
        ],
    )


def assert_no_secret(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, secret


def test_config_yaml_and_params_mask_every_secret(tmp_path):
    cfg = config_with_secrets(tmp_path)
    assert cfg.model.hf_config["token"] == HF_TOKEN, "the running process still has the real value"
    text = to_yaml(cfg)
    assert_no_secret(text)
    assert f"uri: http://alice:{MASK}@127.0.0.1:5000/?access_token={MASK}" in text
    params = to_flat_dict(cfg)
    assert_no_secret(json.dumps(params))
    assert params["model.hf_config.token"] == MASK and params["deepspeed.extra.api_key"] == MASK
    assert params["training.lr"] == cfg.training.lr, "everything else is unchanged"


def test_the_masked_config_yaml_names_the_same_run(tmp_path):
    cfg = config_with_secrets(tmp_path)
    f = tmp_path / "config.yaml"
    f.write_text(to_yaml(cfg))
    assert config_digest(load_config(f)) == config_digest(cfg)


def test_the_run_folder_holds_no_secret(tmp_path):
    from elastictrain.driver.launch import prepare_run_dir

    run_dir, _ = prepare_run_dir(config_with_secrets(tmp_path), fresh=False)
    for path in run_dir.path.rglob("*"):
        if path.is_file():
            assert_no_secret(path.read_text(errors="replace"))


def test_mlflow_params_and_artifacts_hold_no_secret(tmp_path):
    from mlflow.tracking import MlflowClient

    from elastictrain.driver.launch import make_tracker, prepare_run_dir
    from elastictrain.tracking.tracker import default_tracking_uri

    uri = default_tracking_uri(tmp_path / "run")
    cfg = config_with_secrets(tmp_path, uri=uri)
    run_dir, _ = prepare_run_dir(cfg, fresh=False)
    tracker = make_tracker(cfg, run_dir)
    try:
        assert tracker.flush(timeout_s=60)
    finally:
        tracker.close()
    client = MlflowClient(uri)
    run = client.get_run(run_dir.read_info().mlflow_run_id)
    assert run.data.params["model.hf_config.token"] == MASK
    assert_no_secret(json.dumps(run.data.params) + json.dumps(run.data.tags))
    config_artifact = client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path / "dl"))
    assert_no_secret(Path(config_artifact).read_text())
    for path in run_dir.path.rglob("*"):  # the spool too
        if path.is_file() and path.suffix in (".jsonl", ".json", ".yaml", ""):
            assert_no_secret(path.read_text(errors="replace"))


def test_secret_environment_values_and_url_passwords_never_reach_a_log_line(monkeypatch, caplog, tmp_path):
    from elastictrain.tracking.mlflow_tracker import MlflowTracker

    install_log_redaction()
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "env-password-4242")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")
    caplog.set_level(logging.INFO)
    logging.getLogger("anything").warning("connecting with password %s", "env-password-4242")
    # The tracker names its URI when the server does not answer (nothing listens on port 9).
    tracker = MlflowTracker(
        f"http://bob:{URL_PASSWORD}@127.0.0.1:9", "e", run_name="r", spool_dir=tmp_path, start_wait_s=0.5
    )
    try:
        tracker.start()
    finally:
        tracker.close()
    assert "env-password-4242" not in caplog.text and URL_PASSWORD not in caplog.text
    assert f"connecting with password {MASK}" in caplog.text
    assert f"http://bob:{MASK}@127.0.0.1:9" in caplog.text


def test_every_tracker_of_a_run_records_its_uri_without_the_password(tmp_path):
    from elastictrain.rundir.run_dir import RunDir
    from elastictrain.tracking.run_tracker import run_tracker

    rd = RunDir.create(tmp_path / "run", name="r", config_yaml="{}\n", config_digest="d")
    uri = f"http://bob:{URL_PASSWORD}@127.0.0.1:9"
    tracker = run_tracker(rd, uri, "e", start_wait_s=0.0)  # what the driver and `elastictrain sync` build
    assert tracker.on_run_id is not None
    tracker.on_run_id("run-123")  # the tracker learnt the run id from MLflow
    info = rd.read_info()
    assert info.mlflow_run_id == "run-123" and info.mlflow_tracking_uri == f"http://bob:{MASK}@127.0.0.1:9"
    assert URL_PASSWORD not in rd.run_json.read_text()


def test_redaction_holds_when_a_library_installed_its_own_record_factory(monkeypatch, caplog):
    # Ray and others set a LogRecord factory of their own; ours must wrap it, not give up.
    original = logging.getLogRecordFactory()
    try:
        base = original

        def library_factory(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            record = base(*args, **kwargs)
            record.library_field = "kept"
            return record

        logging.setLogRecordFactory(library_factory)
        install_log_redaction()
        install_log_redaction()  # idempotent: one wrapper, not two
        monkeypatch.setenv("SOME_SERVICE_TOKEN", "tok-secret-777777")
        caplog.set_level(logging.INFO)
        logging.getLogger("lib").warning("token is %s", "tok-secret-777777")
        record = caplog.records[-1]
        assert record.getMessage() == f"token is {MASK}"
        assert record.library_field == "kept", "the library's own factory still runs"
    finally:
        logging.setLogRecordFactory(original)


@pytest.mark.parametrize(
    ("key", "secret"),
    [
        ("tracking.token", True),
        ("HF_TOKEN", True),
        ("MLFLOW_TRACKING_PASSWORD", True),
        ("AWS_SECRET_ACCESS_KEY", True),
        ("deepspeed.extra.api_key", True),
        ("model.hf_config.num_key_value_heads", False),
        ("training.max_steps", False),
        ("data.tokenizer", False),
    ],
)
def test_which_names_are_secrets(key, secret):
    assert is_secret_key(key) is secret


def test_redaction_of_text_and_trees():
    assert redact_text("s3://b?X-Amz-Signature=abc123&x=1") == f"s3://b?X-Amz-Signature={MASK}&x=1"
    assert redact_text("postgresql://u:p4ss@db/x") == f"postgresql://u:{MASK}@db/x"
    assert redact({"a": {"password": "x", "n": 1}, "l": ["http://u:pw@h"]}) == {
        "a": {"password": MASK, "n": 1},
        "l": [f"http://u:{MASK}@h"],
    }


def test_the_working_directory_is_not_a_secret_but_a_password_variable_still_is(monkeypatch):
    monkeypatch.setenv("PWD", "/data/project")  # the shell's, not a password
    monkeypatch.setenv("OLDPWD", "/data/before")
    monkeypatch.setenv("DB_PWD", "hunter2-hunter2")
    assert redact_text("nvme_path: /data/project/nvme, was /data/before") == (
        "nvme_path: /data/project/nvme, was /data/before"
    )
    assert redact_text("db at hunter2-hunter2") == f"db at {MASK}"
    assert redact({"deepspeed": {"nvme_path": "/data/project"}}) == {
        "deepspeed": {"nvme_path": "/data/project"}
    }
