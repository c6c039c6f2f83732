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
LOGGED_ARTIFACTS_TAG = "mlflow.loggedArtifacts"  # the tables mlflow.log_table wrote: [{path, type}]


class TrackerError(RuntimeError):
    """The tracker could not be set up (start); once started, nothing it does raises."""


class Tracker(Protocol):
    def start(self) -> str: ...
    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_event(self, record: dict[str, Any]) -> None: ...
    # table: a .json file in mlflow.log_table's layout, listed as a table in the run's tags (MLflow's UI)
    def log_artifact_text(self, text: str, artifact_file: str, *, table: bool = False) -> None: ...
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

    def log_artifact_text(self, text: str, artifact_file: str, *, table: bool = False) -> None:
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


_SQLITE = "sqlite:///"


def sqlite_path(tracking_uri: str) -> str | None:
    """The file of a SQLite store URI, absolute ("/abs/mlflow.db") or relative ("mlflow.db")."""
    if not tracking_uri.startswith(_SQLITE):
        return None
    db = tracking_uri[len(_SQLITE) :].split("?", 1)[0]
    return None if db in ("", ":memory:") else db


def stored_tracking_uri(uri: str, run_dir: Path) -> str:
    """The URI as run.json records it: without its password, and a store inside the run folder
    relative to it, so a moved run folder goes on logging into its own store."""
    from elastictrain.redact import redact_text

    db = sqlite_path(uri)
    if db is None:
        return redact_text(uri)
    path = Path(db).resolve()  # a relative one as this process sees it (its working directory)
    try:
        inside = path.relative_to(Path(run_dir).resolve())
    except ValueError:
        return uri.replace(db, str(path), 1)
    return uri.replace(db, inside.as_posix(), 1)


def resolve_tracking_uri(stored: str, run_dir: Path) -> str:
    """A URI recorded by `stored_tracking_uri`, usable from this run folder wherever it now is."""
    db = sqlite_path(stored)
    if db is None or Path(db).is_absolute():
        return stored
    return stored.replace(db, str(Path(run_dir).resolve() / db), 1)


def artifacts_beside_sqlite(tracking_uri: str) -> str | None:
    # MLflow's default artifact root for a SQL store is relative to the current directory; keep a
    # SQLite store's artifacts next to its database instead (<run_dir>/mlartifacts for the default).
    db = sqlite_path(tracking_uri)
    if db is None:
        return None
    return (Path(db).parent / "mlartifacts").resolve().as_uri()


def now_ms() -> int:
    return int(time.time() * 1000)


# What MLflow answers for a request it rejects as invalid: the same data would be rejected again.
INVALID_REQUEST_CODES = frozenset({"INVALID_PARAMETER_VALUE", "MALFORMED_REQUEST", "BAD_REQUEST"})


def is_permanent(exc: BaseException) -> bool:
    """MLflow rejected the request as invalid (400): resending it will not help.

    Anything else may pass later and stays spooled: 401/403 (an expired token, a rotated password),
    404, 429, 5xx, a proxy's error page, no connection.
    """
    return getattr(exc, "error_code", None) in INVALID_REQUEST_CODES
