"""A run's new SQLite MLflow store, copied from an empty one instead of built by MLflow's migrations."""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import tempfile
from pathlib import Path

from elastictrain.compat.registry import installed_version, patch
from elastictrain.user_cache import cache_folder


def _check() -> str | None:
    from mlflow.store.db import utils
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    if not callable(getattr(utils, "_all_tables_exist", None)):
        return "mlflow.store.db.utils has no _all_tables_exist (the check that skips the migrations)"
    if not callable(getattr(SqlAlchemyStore, "_create_default_experiment", None)):
        return "SqlAlchemyStore has no _create_default_experiment (the Default experiment a copy lacks)"
    return None


def _leave_it_to_mlflow(db: Path) -> bool:
    return False


@patch(
    "mlflow_sqlite_store_from_template",
    package="mlflow",
    tested=">=3.17,<3.18",
    kind="performance",
    check=_check,
    otherwise=_leave_it_to_mlflow,
)
def seed_sqlite_store(db: Path) -> bool:
    """Create the SQLite file `db` of a run's new MLflow store as a copy of an empty, migrated one.

    What: where `db` does not exist yet, copies `~/.cache/elastictrain/mlflow-<version>-empty.db` there
    (built once per MLflow release: MLflow makes a store, then its Default experiment, whose artifact
    location is the builder's folder, is deleted; MLflow adds the store's own at the first connection).
    Returns whether it made `db`. Never replaces a file: a store another process created first stays.
    Why: MLflow creates a new SQLite store by running its schema migrations (alembic), 0.6-1.4 CPU
    seconds on 2 cores; opening a copy of a migrated one takes 0.04 s. Every new run (and every test
    run) pays it on the driver before its first metric.
    Retired by: MLflow creating a new SQLite store from its final schema rather than by replaying
    every migration; no upstream issue found.
    """
    if db.exists():
        return False
    try:
        template = _template()
        db.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".mlflow-", suffix=".db", dir=db.parent)
        os.close(fd)
        try:
            shutil.copyfile(template, tmp)
            os.link(tmp, db)  # fails where the file exists: a store made meanwhile is never replaced
        finally:
            os.unlink(tmp)
    except (OSError, sqlite3.Error):
        return False  # MLflow makes the store itself, as without this patch
    return True


def _template() -> Path:
    """The empty migrated store for the installed MLflow, built where the cache lacks it."""
    version = installed_version("mlflow")
    path = cache_folder() / f"mlflow-{version}-empty.db"
    if path.exists():
        return path
    from mlflow.tracking import MlflowClient

    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as folder:
        built = Path(folder) / "empty.db"
        MlflowClient(f"sqlite:///{built}").search_experiments()  # the migrations, once
        with contextlib.closing(sqlite3.connect(built)) as con, con:
            con.execute("DELETE FROM experiment_tags WHERE experiment_id = 0")
            con.execute("DELETE FROM experiments WHERE experiment_id = 0")
        os.replace(built, path)  # whole or absent, whoever builds it at the same time
    return path
