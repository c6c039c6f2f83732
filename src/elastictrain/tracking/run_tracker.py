"""The one place a run's MLflow tracker is built: spooled in its run folder, the run id recorded there.

Both the driver and `elastictrain sync` build it here, so the tracking URI goes into run.json only
without its password (redact.py), whichever of them learns the run id, and the embedded store
relative to the run folder.
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

from elastictrain.rundir.run_dir import RunDir
from elastictrain.tracking.mlflow_tracker import MlflowTracker
from elastictrain.tracking.tracker import default_tracking_uri, resolve_tracking_uri, stored_tracking_uri

ARTIFACTS = "/mlartifacts"


def tracking_uri_of(run_dir: RunDir, configured: str | None) -> str:
    """The URI a run logs to: the config's, else the one its run folder recorded, else its embedded store."""
    stored = run_dir.read_info().mlflow_tracking_uri
    if configured:
        return configured
    local = run_dir.local_dir
    return resolve_tracking_uri(stored, local) if stored else default_tracking_uri(local)


def follow_moved_store(run_path: Path) -> None:
    """MLflow keeps absolute artifact locations in its store: after the run folder moved, point the
    embedded store's back inside it (else artifacts would go to, and recreate, the old place)."""
    db = run_path / "mlflow.db"
    if not db.is_file():
        return
    new_root = (run_path / "mlartifacts").resolve().as_uri()
    with contextlib.closing(sqlite3.connect(db)) as con, con:
        old_roots = {
            loc
            for (loc,) in con.execute("SELECT artifact_location FROM experiments")
            if isinstance(loc, str) and loc.endswith(ARTIFACTS) and loc != new_root
        }
        for old in old_roots:
            for table, column in (
                ("experiments", "artifact_location"),
                ("runs", "artifact_uri"),
                ("logged_models", "artifact_location"),
            ):
                with contextlib.suppress(sqlite3.OperationalError):  # a table older stores lack
                    con.execute(
                        f"UPDATE {table} SET {column} = ? || substr({column}, ?) "  # noqa: S608 - fixed names
                        f"WHERE substr({column}, 1, ?) = ?",
                        (new_root, len(old) + 1, len(old), old),
                    )
    if old_roots:
        # MLflow caches each run's artifact location per process (a resume inside one process).
        from elastictrain.compat.mlflow.artifact_cache import clear_artifact_locations

        clear_artifact_locations()


def run_tracker(
    run_dir: RunDir,
    uri: str,
    experiment: str,
    *,
    start_wait_s: float = 5.0,
    max_spool_mb: float | None = None,
) -> MlflowTracker:
    info = run_dir.read_info()
    local = run_dir.local_dir  # the run folder, or this machine's folder for a run on an object store
    local.mkdir(parents=True, exist_ok=True)
    if uri == default_tracking_uri(local):
        follow_moved_store(local)

    def record_run_id(run_id: str) -> None:
        run_dir.update(mlflow_run_id=run_id, mlflow_tracking_uri=stored_tracking_uri(uri, local))

    return MlflowTracker(
        uri,
        experiment,
        run_name=info.name,
        run_id=info.mlflow_run_id,
        tags={"elastictrain.run_id": info.run_id},
        # Everything is spooled in the run folder first: an MLflow outage loses nothing (mlflow_tracker.py).
        spool_dir=local,
        on_run_id=record_run_id,
        start_wait_s=start_wait_s,
        max_spool_mb=max_spool_mb,
    )
