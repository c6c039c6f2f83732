"""The run folder: everything needed to inspect or resume a run, in plain files.

RUN_DIR/
  run.json       state of the run (RunInfo), replaced atomically on every update
  config.yaml    the resolved config, written once at creation
  events.jsonl   append-only lifecycle log, one JSON object per line
  checkpoints/   owned by the checkpoint store
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from elastictrain.core.state import RunStatus
from elastictrain.redact import redact
from elastictrain.storage import AnyPath, as_path, storage_of
from elastictrain.user_cache import cache_folder

log = logging.getLogger("elastictrain.rundir.run_dir")

RUN_JSON = "run.json"
CONFIG_YAML = "config.yaml"
EVENTS_JSONL = "events.jsonl"
CHECKPOINTS = "checkpoints"

Clock = Callable[[], datetime]


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


def _iso(t: datetime) -> str:
    # A naive clock is taken to be UTC so every timestamp in the folder compares alike.
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return t.astimezone(timezone.utc).isoformat()


def local_state_dir(path: AnyPath) -> Path:
    if isinstance(path, Path):
        return path
    # One folder per URL on this machine, so a driver started here again finds its spool.
    return cache_folder() / "object-runs" / path.protocol / path.key


class RunDirError(Exception):
    """The folder is not a usable run folder; the message names the path and what was expected."""


@dataclass
class RunInfo:
    run_id: str
    name: str
    status: str
    created_at: str
    updated_at: str
    config_digest: str
    mlflow_run_id: str | None = None
    mlflow_tracking_uri: str | None = None
    world_size_history: list[dict[str, Any]] = field(default_factory=list)
    last_step: int = 0
    # The furthest step whose metrics were logged: steps redone after a failure are not logged twice.
    logged_step: int = 0
    last_metrics: dict[str, Any] = field(default_factory=dict)
    failures: int = 0
    skipped_steps: int = (
        0  # steps not applied: their loss or gradients were not finite (control/bad_steps.py)
    )
    message: str | None = None
    # Keys written by a newer version are kept so that an update does not silently drop them.
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        extra = d.pop("extra")
        return {**extra, **d}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunInfo:
        known = {f.name for f in fields(cls)} - {"extra"}
        required = ("run_id", "name", "status", "created_at", "updated_at", "config_digest")
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"missing keys {missing}")
        return cls(
            **{k: v for k, v in d.items() if k in known},
            extra={k: v for k, v in d.items() if k not in known},
        )


_UPDATABLE = {f.name for f in fields(RunInfo)} - {"run_id", "created_at", "updated_at", "extra"}
_STATUSES = {s.value for s in RunStatus}


class RunDir:
    def __init__(self, path: str | AnyPath, clock: Clock = utc_now) -> None:
        self._path = as_path(path)  # a local folder, or a URL on an object store (storage/)
        self._io = storage_of(self._path)
        self._clock = clock
        # Serialises read-modify-write of run.json and appends between threads of this process;
        # only one driver process owns a run folder.
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return f"RunDir({str(self._path)!r})"

    # ------------------------------------------------------------------ paths
    @property
    def path(self) -> AnyPath:
        return self._path

    @property
    def run_json(self) -> AnyPath:
        return self._path / RUN_JSON

    @property
    def config_yaml(self) -> AnyPath:
        return self._path / CONFIG_YAML

    @property
    def events_path(self) -> AnyPath:
        return self._path / EVENTS_JSONL

    @property
    def local_dir(self) -> Path:
        """Where this driver keeps what cannot live on an object store (the MLflow spool; without
        tracking.uri, the embedded MLflow store): the run folder itself when it is local."""
        return local_state_dir(self._path)

    @property
    def checkpoints_dir(self) -> AnyPath:
        return self._path / CHECKPOINTS

    # ------------------------------------------------------------------ lifecycle
    @staticmethod
    def exists(path: str | AnyPath) -> bool:
        return (as_path(path) / RUN_JSON).is_file()

    @classmethod
    def create(
        cls,
        path: str | AnyPath,
        *,
        name: str,
        config_yaml: str,
        config_digest: str,
        clock: Clock = utc_now,
    ) -> RunDir:
        rd = cls(path, clock)
        if cls.exists(rd.path):
            raise RunDirError(
                f"{rd.path} already holds a run ({RUN_JSON} exists); resume it, or choose another folder"
            )
        if rd.path.exists() and not rd.path.is_dir():
            raise RunDirError(f"{rd.path} exists and is not a folder; a run folder was expected there")
        rd.path.mkdir(parents=True, exist_ok=True)
        rd._io.write(rd.config_yaml, config_yaml.encode("utf-8"))
        now = _iso(rd._clock())
        info = RunInfo(
            run_id=uuid.uuid4().hex,
            name=name,
            status=RunStatus.CREATED.value,
            created_at=now,
            updated_at=now,
            config_digest=config_digest,
        )
        # run.json goes last: its presence is what marks the folder as a complete run folder.
        rd._write_info(info)
        rd._io.sync_folder(rd.path.parent)
        return rd

    @classmethod
    def open(cls, path: str | AnyPath, clock: Clock = utc_now) -> RunDir:
        rd = cls(path, clock)
        if not rd.path.is_dir():
            raise RunDirError(
                f"{rd.path} does not exist or is not a folder; expected an elastictrain run folder"
            )
        if not rd.run_json.is_file():
            raise RunDirError(
                f"{rd.path} is not an elastictrain run folder (no {RUN_JSON}); "
                "expected a folder made by `elastictrain train` (run.dir)"
            )
        rd.read_info()  # fails now, with a clear message, when run.json is corrupt
        return rd

    # ------------------------------------------------------------------ run.json
    def read_info(self) -> RunInfo:
        try:
            text = self.run_json.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise RunDirError(
                f"{self.path} is not an elastictrain run folder (no {RUN_JSON}); "
                "expected a folder made by `elastictrain train` (run.dir)"
            ) from None
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            return RunInfo.from_dict(data)
        except (ValueError, TypeError) as e:
            raise RunDirError(
                f"{self.run_json} is corrupt ({e}); expected the JSON object elastictrain writes"
            ) from e

    def _write_info(self, info: RunInfo) -> None:
        # Masked here, whatever wrote it: a worker's error message may quote a token.
        self._io.replace_text(
            self.run_json, json.dumps(redact(info.to_dict(), by_key=False), indent=2) + "\n"
        )

    def update(self, **changes: Any) -> RunInfo:
        unknown = sorted(set(changes) - _UPDATABLE)
        if unknown:
            raise TypeError(
                f"RunDir.update: unknown or read-only fields {unknown}; allowed: {sorted(_UPDATABLE)}"
            )
        if "status" in changes:
            status = changes["status"]
            status = status.value if isinstance(status, RunStatus) else str(status)
            if status not in _STATUSES:
                raise ValueError(f"unknown run status {status!r}; expected one of {sorted(_STATUSES)}")
            changes["status"] = status
        with self._lock:
            info = self.read_info()
            for k, v in changes.items():
                setattr(info, k, v)
            info.updated_at = _iso(self._clock())
            self._write_info(info)
            return info

    def set_extra(self, key: str, value: Any) -> RunInfo:
        """Set a key of run.json outside RunInfo's fields (e.g. "driver": who drives the run now)."""
        known = {f.name for f in fields(RunInfo)}
        if key in known:
            raise TypeError(f"RunDir.set_extra: {key!r} is a RunInfo field; use update({key}=...)")
        with self._lock:
            info = self.read_info()
            info.extra[key] = value
            info.updated_at = _iso(self._clock())
            self._write_info(info)
            return info

    def record_world_size(self, step: int, world_size: int, reason: str) -> None:
        """History of the sizes the run trained at: a new entry only when the size changes."""
        with self._lock:
            history = self.read_info().world_size_history
            if history and history[-1].get("world_size") == world_size:
                return
            entry = {"time": _iso(self._clock()), "step": step, "world_size": world_size, "reason": reason}
            self.update(world_size_history=[*history, entry])

    # ------------------------------------------------------------------ events.jsonl
    def append_event(self, event: str, **fields: Any) -> dict[str, Any]:
        if "time" in fields:
            raise ValueError("append_event: 'time' is set by the run folder's clock")
        # Masked before it is written; the caller passes the returned record on (MLflow, terminal).
        record: dict[str, Any] = redact({"time": _iso(self._clock()), "event": event, **fields}, by_key=False)
        with self._lock:
            self._io.append_line(self.events_path, json.dumps(record, default=str))
        return record

    def read_events(self) -> list[dict[str, Any]]:
        try:
            text = self.events_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return []
        events: list[dict[str, Any]] = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if isinstance(record, dict):
                events.append(record)
            else:
                # Torn by a crash mid-write (append_event starts the next record on a fresh line).
                log.warning("%s:%d: skipping an unreadable line (torn by a crash?)", self.events_path, n)
        return events

    # ------------------------------------------------------------------ config.yaml
    def read_config_yaml(self) -> str:
        try:
            return self.config_yaml.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise RunDirError(
                f"{self.path} has no {CONFIG_YAML}; the run folder is incomplete "
                "(expected the resolved config)"
            ) from None


def _created_key(item: tuple[AnyPath, RunInfo]) -> tuple[datetime, str]:
    path, info = item
    try:
        t = datetime.fromisoformat(info.created_at)
        if t.tzinfo is None:
            t = t.replace(tzinfo=timezone.utc)
    except (TypeError, ValueError):
        t = datetime.min.replace(tzinfo=timezone.utc)
    return t, str(path)


def list_runs(root: str | AnyPath) -> list[tuple[AnyPath, RunInfo]]:
    """Run folders at root or up to two levels below it, oldest first; unreadable ones are skipped."""
    root = as_path(root)
    if not root.is_dir():
        return []
    candidates = [root / RUN_JSON, *root.glob(f"*/{RUN_JSON}"), *root.glob(f"*/*/{RUN_JSON}")]
    found: list[tuple[AnyPath, RunInfo]] = []
    for run_json in candidates:
        if not run_json.is_file():
            continue
        try:
            found.append((run_json.parent, RunDir(run_json.parent).read_info()))
        except RunDirError as e:
            log.warning("skipping %s: %s", run_json.parent, e)
    return sorted(found, key=_created_key)
