"""What the loop needs of a tracker (`Tracker`), one that tracks nothing, and what MLflow accepts.

The MLflow tracker itself is mlflow_tracker.py (the caller's side) and mlflow_send.py (its thread).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any, Protocol

# MLflow's limits (mlflow.utils.validation); repeated here so the module imports without mlflow.
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000
MAX_PARAM_VAL_LENGTH = 6000
MAX_TAG_VAL_LENGTH = 8000
MAX_KEY_LENGTH = 250

TERMINAL_STATUSES = ("FINISHED", "FAILED", "KILLED")
EVENTS_ARTIFACT = "events.jsonl"


class TrackerError(RuntimeError):
    """The tracker could not be set up (start); once started, nothing it does raises."""


class Tracker(Protocol):
    def start(self) -> str: ...
    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_event(self, record: dict[str, Any]) -> None: ...
    def log_artifact_text(self, text: str, artifact_file: str) -> None: ...
    def finish(self, status: str) -> None: ...
    def close(self) -> None: ...


class NullTracker:
    """Tracks nothing: for tests and --no-tracking."""

    run_id = ""

    def start(self) -> str:
        return ""

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_event(self, record: dict[str, Any]) -> None:
        pass

    def log_artifact_text(self, text: str, artifact_file: str) -> None:
        pass

    def flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def finish(self, status: str) -> None:
        pass

    def close(self) -> None:
        pass


_BAD_KEY_CHARS = re.compile(r"[^\w./\- ]")


def sanitize_key(key: str) -> str:
    """A name MLflow accepts for a metric, param or tag: allowed characters, a normalised path.

    Colons are replaced too (MLflow refuses them on Windows stores), as are empty, "." and ".."
    path segments, which MLflow rejects as non-unique paths.
    """
    key = _BAD_KEY_CHARS.sub("_", str(key))
    parts = [p if p not in (".", "..") else "_" for p in key.split("/") if p]
    return ("/".join(parts) or "_")[:MAX_KEY_LENGTH].rstrip("/") or "_"


def default_tracking_uri(run_dir: Path) -> str:
    """A SQLite store inside the run folder, so a run folder is self-contained and movable between runs."""
    return f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}"


def artifacts_beside_sqlite(tracking_uri: str) -> str | None:
    # MLflow's default artifact root for a SQL store is relative to the current directory; keep a
    # SQLite store's artifacts next to its database instead (<run_dir>/mlartifacts for the default).
    prefix = "sqlite:///"
    if not tracking_uri.startswith(prefix):
        return None
    # What follows the prefix is the file path, absolute ("/abs/mlflow.db") or relative ("mlflow.db").
    db = tracking_uri[len(prefix) :].split("?", 1)[0]
    if db in ("", ":memory:"):
        return None
    return (Path(db).parent / "mlartifacts").resolve().as_uri()


def now_ms() -> int:
    return int(time.time() * 1000)


def is_permanent(exc: BaseException) -> bool:
    """MLflow refused the request itself (4xx): retrying the same data will not help."""
    code = getattr(exc, "get_http_status_code", None)
    try:
        return code is not None and 400 <= int(code()) < 500
    except Exception:
        return False
