from __future__ import annotations

import json
import threading
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from elastictrain.rundir.run_dir import RunDir, RunDirError, RunInfo, list_runs


def ticking_clock(start: datetime | None = None) -> Callable[[], datetime]:
    """Each call is one second after the previous one."""
    t = [start or datetime(2026, 1, 1, tzinfo=timezone.utc)]

    def clock() -> datetime:
        t[0] += timedelta(seconds=1)
        return t[0]

    return clock


def make(path: Path, name: str = "demo", clock: Callable[[], datetime] | None = None) -> RunDir:
    return RunDir.create(
        path, name=name, config_yaml="model: tiny\n", config_digest="abc123", clock=clock or ticking_clock()
    )


def test_create_writes_config_and_run_json(tmp_path: Path) -> None:
    rd = make(tmp_path / "run")
    assert RunDir.exists(tmp_path / "run")
    assert rd.read_config_yaml() == "model: tiny\n"
    raw = json.loads(rd.run_json.read_text())
    assert raw["status"] == "CREATED"
    assert raw["name"] == "demo" and raw["config_digest"] == "abc123"
    assert len(raw["run_id"]) == 32 and int(raw["run_id"], 16) >= 0
    assert raw["created_at"] == raw["updated_at"] == "2026-01-01T00:00:01+00:00"
    assert raw["mlflow_run_id"] is None and raw["mlflow_tracking_uri"] is None
    assert raw["world_size_history"] == [] and raw["last_step"] == 0 and raw["failures"] == 0
    assert rd.checkpoints_dir == tmp_path / "run" / "checkpoints"
    assert rd.events_path == tmp_path / "run" / "events.jsonl"
    assert not list(rd.path.glob(".*tmp*")), "no temporary file is left behind"


def test_create_refuses_an_existing_run(tmp_path: Path) -> None:
    rd = make(tmp_path / "run")
    before = rd.run_json.read_text()
    with pytest.raises(RunDirError, match="already holds a run"):
        make(tmp_path / "run", name="other")
    assert rd.run_json.read_text() == before


def test_create_accepts_an_existing_folder_without_run_json(tmp_path: Path) -> None:
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert make(tmp_path / "run").read_info().status == "CREATED"


def test_open_round_trips_info(tmp_path: Path) -> None:
    rd = make(tmp_path / "run")
    assert RunDir.open(tmp_path / "run").read_info() == rd.read_info()


def test_open_refuses_a_folder_that_is_not_a_run(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    with pytest.raises(RunDirError, match=r"plain is not an elastictrain run folder \(no run.json\)"):
        RunDir.open(tmp_path / "plain")
    with pytest.raises(RunDirError, match="does not exist"):
        RunDir.open(tmp_path / "missing")
    assert not RunDir.exists(tmp_path / "plain")


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"name": "x"}'])
def test_open_refuses_a_corrupt_run_json(tmp_path: Path, content: str) -> None:
    rd = make(tmp_path / "run")
    rd.run_json.write_text(content)
    with pytest.raises(RunDirError, match="run.json is corrupt"):
        RunDir.open(rd.path)


def test_update_sets_fields_and_updated_at(tmp_path: Path) -> None:
    rd = make(tmp_path / "run")
    info = rd.update(status="RUNNING", last_step=7, last_metrics={"loss": 1.5}, mlflow_run_id="r1")
    assert info == rd.read_info()
    assert (info.status, info.last_step, info.last_metrics, info.mlflow_run_id) == (
        "RUNNING",
        7,
        {"loss": 1.5},
        "r1",
    )
    assert info.updated_at > info.created_at
    with pytest.raises(ValueError, match="unknown run status"):
        rd.update(status="DANCING")
    with pytest.raises(TypeError, match="unknown or read-only"):
        rd.update(run_id="forged")
    assert rd.read_info().status == "RUNNING"


def test_update_keeps_keys_from_a_newer_version(tmp_path: Path) -> None:
    rd = make(tmp_path / "run")
    raw = json.loads(rd.run_json.read_text())
    rd.run_json.write_text(json.dumps({**raw, "future_field": [1, 2]}))
    rd.update(last_step=3)
    assert json.loads(rd.run_json.read_text())["future_field"] == [1, 2]


def test_concurrent_updates_always_leave_valid_json(tmp_path: Path) -> None:
    rd = make(tmp_path / "run")
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            try:
                json.loads(rd.run_json.read_text())  # never torn: replaced by rename
            except BaseException as e:  # pragma: no cover - the failure being tested for
                errors.append(e)

    def writer(k: int) -> None:
        for i in range(50):
            rd.update(last_step=i, last_metrics={"w": k, "i": i})

    r = threading.Thread(target=reader)
    r.start()
    writers = [threading.Thread(target=writer, args=(k,)) for k in range(3)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    stop.set()
    r.join()
    assert not errors
    assert rd.read_info().last_step == 49
    assert not [p for p in rd.path.iterdir() if "tmp" in p.name]


def test_world_size_history_appends_only_on_change(tmp_path: Path) -> None:
    rd = make(tmp_path / "run")
    rd.record_world_size(0, 4, "start")
    rd.record_world_size(10, 4, "recovered")  # same size: no entry
    rd.record_world_size(20, 3, "worker lost")
    rd.record_world_size(21, 3, "worker lost")
    rd.record_world_size(50, 4, "capacity back")
    history = rd.read_info().world_size_history
    assert [(h["step"], h["world_size"], h["reason"]) for h in history] == [
        (0, 4, "start"),
        (20, 3, "worker lost"),
        (50, 4, "capacity back"),
    ]
    assert all(isinstance(h["time"], str) for h in history)


def test_events_append_and_read_back(tmp_path: Path) -> None:
    rd = make(tmp_path / "run")
    first = rd.append_event("start", step=0, message="hello")
    rd.append_event("resize", step=5, world_size=3, path=Path("/x"))
    assert first["event"] == "start" and first["time"].endswith("+00:00")
    events = rd.read_events()
    assert [e["event"] for e in events] == ["start", "resize"]
    assert events[1]["world_size"] == 3 and events[1]["path"] == "/x"
    assert all(set(e) >= {"time", "event"} for e in events)
    with pytest.raises(ValueError):
        rd.append_event("x", time="forged")


def test_events_torn_last_line_is_skipped_and_the_next_append_is_readable(tmp_path: Path) -> None:
    rd = make(tmp_path / "run")
    assert rd.read_events() == []
    rd.append_event("start", step=0)
    with open(rd.events_path, "a") as f:
        f.write('{"time": "2026-01-01T00:00:09+00:00", "event": "che')  # crash mid-write
    assert [e["event"] for e in rd.read_events()] == ["start"]
    rd.append_event("resume", step=0)
    assert [e["event"] for e in rd.read_events()] == ["start", "resume"]


def test_list_runs_finds_runs_two_levels_down_oldest_first(tmp_path: Path) -> None:
    clock = ticking_clock()
    make(tmp_path / "b", name="second", clock=clock)
    make(tmp_path / "team" / "a", name="third", clock=clock)
    (tmp_path / "team" / "deep" / "deeper").mkdir(parents=True)
    make(tmp_path / "team" / "deep" / "deeper" / "c", name="too-deep", clock=clock)
    (tmp_path / "not-a-run").mkdir()
    broken = make(tmp_path / "broken", name="broken", clock=clock)
    broken.run_json.write_text("{")
    early = make(tmp_path / "z", name="first", clock=ticking_clock(datetime(2025, 1, 1, tzinfo=timezone.utc)))
    found = list_runs(tmp_path)
    assert [info.name for _, info in found] == ["first", "second", "third"]
    assert found[0][0] == early.path
    assert all(isinstance(info, RunInfo) for _, info in found)
    assert list_runs(tmp_path / "nowhere") == []
