"""Issue 6.3: an MLflow outage loses nothing and never holds training up.

Real `mlflow server` processes on loopback, stopped and started on the same port; a real child process
killed (SIGKILL) with records still unsent; `elastictrain sync` sending the spool afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from elastictrain.cli import app
from elastictrain.config import load_config, to_yaml
from elastictrain.rundir.run_dir import RunDir
from elastictrain.tracking.mlflow_tracker import MlflowTracker
from elastictrain.tracking.spool import Spool

pytestmark = pytest.mark.integration
STEPS = range(1, 31)


@pytest.fixture(autouse=True)
def fail_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    # A down server is seen in 2 s instead of after MLflow's default retries.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_root(tmp_path: Path) -> Path:
    root = tmp_path / "server"
    root.mkdir(exist_ok=True)
    return root


def make_run_dir(path: Path, uri: str) -> RunDir:
    cfg = load_config(None, [f"run.dir={path}", f"tracking.uri={uri}", "tracking.experiment=outage"])
    rd = RunDir.create(path, name="outage", config_yaml=to_yaml(cfg), config_digest="d")
    rd.update(mlflow_tracking_uri=uri)
    return rd


def tracker_for(rd: RunDir, uri: str) -> MlflowTracker:
    info = rd.read_info()
    return MlflowTracker(
        uri,
        "outage",
        run_name="outage",
        run_id=info.mlflow_run_id,
        flush_interval_s=0.2,
        spool_dir=rd.path,
        on_run_id=lambda rid: rd.update(mlflow_run_id=rid),
        start_wait_s=1.0,
        # Far fewer than an outage piles up: the rest waits in the spool file and is read back from it.
        max_pending_metrics=10,
    )


def log_steps(tracker: MlflowTracker, steps: range) -> None:
    for step in steps:
        tracker.log_metrics({"loss": 100.0 / step, "step_time_s": 0.5}, step=step)
        if step % 10 == 0:
            tracker.log_event({"event": "checkpoint", "step": step})


@contextlib.contextmanager
def patient_reads() -> Iterator[None]:
    """Reading back what arrived: the 2 s and no retries above are for the sends under test, and a server
    busy under a loaded suite once took longer than a read timeout that short (test_mlflow_refusals)."""
    with mock.patch.dict(
        os.environ, {"MLFLOW_HTTP_REQUEST_TIMEOUT": "60", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3"}
    ):
        yield


def check_every_step_once(uri: str, rd: RunDir, steps: range) -> None:
    with patient_reads():
        _check_every_step_once(uri, rd, steps)


def _check_every_step_once(uri: str, rd: RunDir, steps: range) -> None:
    client = MlflowClient(uri)
    run_id = rd.read_info().mlflow_run_id
    assert run_id
    history = client.get_metric_history(run_id, "loss")
    assert sorted(m.step for m in history) == list(steps), "every step exactly once"
    assert all(m.value == pytest.approx(100.0 / m.step) for m in history)
    # ... and in the order they were logged (MLflow keeps arrival order per key).
    assert [m.step for m in history] == list(steps)
    assert client.get_run(run_id).data.params["lr"] == "0.003"
    events = client.download_artifacts(run_id, "events.jsonl", str(rd.path / "dl"))
    lines = [json.loads(x) for x in Path(events).read_text().splitlines()]
    assert [e["step"] for e in lines] == [s for s in steps if s % 10 == 0]


def test_a_server_down_from_the_start_gets_everything_once_when_it_is_back(
    tmp_path: Path, mlflow_server_factory
) -> None:
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    rd = make_run_dir(tmp_path / "run", uri)
    tracker = tracker_for(rd, uri)
    try:
        assert tracker.start() == "", "no server: the run is created later, training starts now"
        tracker.log_params({"lr": 0.003})
        log_steps(tracker, STEPS)
        assert tracker.flush(timeout_s=1) is False
        assert tracker.spooled == 1 + len(STEPS) + 3, "every call is on disk in the run folder"
        assert tracker.pending_metrics <= 10, "memory stays bounded during the outage"
        assert rd.read_info().mlflow_run_id is None
        with mlflow_server_factory(server_root(tmp_path), port):
            assert tracker.flush(timeout_s=60) is True
            check_every_step_once(uri, rd, STEPS)
            assert tracker.spooled == 0
            assert (rd.path / "tracking-spool" / "spool.jsonl").stat().st_size == 0, "emptied once sent"
    finally:
        tracker.close()


CHILD = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from pathlib import Path
    from elastictrain.rundir.run_dir import RunDir
    from test_mlflow_outage import tracker_for, log_steps
    rd = RunDir.open(sys.argv[1])
    tracker = tracker_for(rd, sys.argv[2])
    tracker.start()
    if sys.argv[4] == "log":  # else only send what an earlier process spooled
        tracker.log_params({{"lr": 0.003}})
        log_steps(tracker, range(1, 31))
    tracker.flush(timeout_s=float(sys.argv[3]))
    os.kill(os.getpid(), signal.SIGKILL)  # the driver dies with whatever is still unsent
    """
)


def run_child(rd: RunDir, uri: str, flush_s: float, crash_at: str | None = None, *, log: bool = True) -> None:
    env = {**os.environ, **({"ELASTICTRAIN_CRASH_AT": crash_at} if crash_at else {})}
    code = CHILD.format(tests=str(Path(__file__).parent))
    child = subprocess.run(
        [sys.executable, "-c", code, str(rd.path), uri, str(flush_s), "log" if log else "send"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == -9, child.stderr[-3000:]


def test_a_driver_killed_during_an_outage_loses_nothing_and_sync_sends_it_once(
    tmp_path: Path, mlflow_server_factory
) -> None:
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    rd = make_run_dir(tmp_path / "run", uri)
    run_child(rd, uri, flush_s=0.5)  # nothing listens: all of it stays in the spool
    cli = CliRunner()
    down = cli.invoke(app, ["sync", str(rd.path), "--timeout", "2"])
    assert down.exit_code == 1 and "stay spooled" in down.output, down.output
    with mlflow_server_factory(server_root(tmp_path), port):
        result = cli.invoke(app, ["sync", str(rd.path), "--timeout", "60"])
        assert result.exit_code == 0, result.output
        assert "sent 34 spooled record(s)" in result.output
        check_every_step_once(uri, rd, STEPS)
        again = cli.invoke(app, ["sync", str(rd.path)])
        assert again.exit_code == 0 and "sent 0" in again.output
        check_every_step_once(uri, rd, STEPS)


def test_sync_of_a_folder_that_is_not_a_run(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["sync", str(tmp_path)])
    assert result.exit_code == 2 and "not an elastictrain run folder" in result.output


def test_the_spool_survives_a_torn_line_and_drops_acked_records_as_it_grows(tmp_path: Path) -> None:
    from elastictrain.tracking.spool import COMPACT_BYTES

    spool = Spool(tmp_path)
    for i in range(3):
        spool.append("event", f"line {i}")
    spool.close()
    with open(spool.path, "a") as f:
        f.write('{"seq": 4, "kind": "ev')  # a crash mid-append
    spool = Spool(tmp_path)
    assert spool.last_seq == 3
    spool.append("event", "after the crash")
    assert [r["data"] for r in spool.read()] == ["line 0", "line 1", "line 2", "after the crash"]
    big = "x" * 1000
    while spool.path.stat().st_size <= COMPACT_BYTES:
        spool.append("event", big)
    spool.ack(spool.last_seq - 2)  # all but the last two reached MLflow
    assert [r["seq"] for r in spool.read()] == [spool.last_seq - 1, spool.last_seq]
    assert spool.path.stat().st_size < 10_000, "acked records were dropped from the file"
    last = spool.last_seq
    spool.close()
    again = Spool(tmp_path)
    assert again.last_seq == last and again.acked == last - 2
    again.ack(last)
    assert again.path.stat().st_size == 0
    # The highest metric step ever spooled outlives the records (a restarted driver logs no step twice).
    again.append("metrics", [["loss", 1.0, 0, 28]])
    assert Spool(tmp_path).max_step == 28
    again.ack(again.last_seq)
    again.close()
    assert Spool(tmp_path).max_step == 28 and Spool(tmp_path).read() == []


def test_replayed_metrics_read_back_from_the_spool_are_not_sent_twice(
    tmp_path: Path, mlflow_server_factory
) -> None:
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    rd = make_run_dir(tmp_path / "run", uri)
    run_child(rd, uri, flush_s=0.5)  # nothing listens: all of it is spooled
    with mlflow_server_factory(server_root(tmp_path), port):
        # The next process sends it in batches of 10 (its max_pending_metrics) and is killed after the
        # third reached MLflow, before any ack: 30 sent metrics of which only 10 fit in the memory of
        # the process that replays them; the other 20 come back from the spool.
        run_child(rd, uri, flush_s=30, crash_at="tracking_metrics_sent@3", log=False)
        with patient_reads():
            history = MlflowClient(uri).get_metric_history(str(rd.read_info().mlflow_run_id), "loss")
        assert len(history) == 15
        # The 15 steps in MLflow are still unacked in the spool: the next process must recognise them.
        spooled = [m for r in Spool(rd.path).read() if r["kind"] == "metrics" for m in r["data"]]
        assert sorted(m[3] for m in spooled if m[0] == "loss") == list(STEPS), "not acked yet"
        sent: list[tuple[str, int]] = []

        class CountingClient(MlflowClient):
            # MLflow's SQL store ignores an exact duplicate, so count what is sent, not what is stored.
            def log_batch(self, run_id, metrics=(), params=(), tags=(), synchronous=None):  # noqa: ANN001, ANN201
                sent.extend((m.key, m.step) for m in metrics)
                return super().log_batch(run_id, metrics, params, tags, synchronous=synchronous)

        tracker = tracker_for(rd, uri)
        tracker._client = CountingClient(uri)
        try:
            tracker.start()
            assert tracker.flush(timeout_s=60)
        finally:
            tracker.close()
        assert sorted(step for key, step in sent if key == "loss") == list(range(16, 31)), "only the unsent"
        check_every_step_once(uri, rd, STEPS)
