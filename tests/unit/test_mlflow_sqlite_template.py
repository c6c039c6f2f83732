"""A run's new SQLite MLflow store is a copy of an empty migrated one (compat/mlflow/sqlite_template.py)."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from elastictrain.compat.mlflow.sqlite_template import seed_sqlite_store


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTICTRAIN_CACHE", str(tmp_path / "cache"))


def tables(db: Path) -> dict[str, list[str]]:
    """Each table's and index's definition, its lines sorted: MLflow's migrations order a table's
    constraints differently from one process to the next."""
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT name, sql FROM sqlite_master WHERE type IN ('table', 'index')")
        return {
            name: sorted(line.strip().rstrip(",") for line in (sql or "").splitlines()) for name, sql in rows
        }


def test_a_seeded_store_has_the_schema_and_default_experiment_of_one_mlflow_made(tmp_path: Path):
    seeded, made = tmp_path / "seeded" / "mlflow.db", tmp_path / "made" / "mlflow.db"
    assert seed_sqlite_store(seeded) is True
    assert list((tmp_path / "cache").glob("mlflow-*-empty.db"))  # built once, kept
    made.parent.mkdir()
    clients = {db: MlflowClient(f"sqlite:///{db}") for db in (seeded, made)}
    defaults = {db: c.get_experiment("0") for db, c in clients.items()}
    assert tables(seeded) == tables(made)
    with sqlite3.connect(seeded) as a, sqlite3.connect(made) as b:
        assert (
            a.execute("SELECT * FROM alembic_version").fetchall()
            == b.execute("SELECT * FROM alembic_version").fetchall()
        )
    # The Default experiment is the store's own (made at the first connection), not the template's.
    assert defaults[seeded].name == defaults[made].name == "Default"
    assert defaults[seeded].artifact_location == defaults[made].artifact_location
    assert "cache" not in defaults[seeded].artifact_location
    client = clients[seeded]
    run = client.create_run(client.create_experiment("runs", artifact_location=str(tmp_path / "art")))
    client.log_metric(run.info.run_id, "loss", 1.5, step=3)
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [(3, 1.5)]


def test_an_existing_file_is_never_replaced_and_a_second_seed_uses_the_cached_template(tmp_path: Path):
    db = tmp_path / "run" / "mlflow.db"
    db.parent.mkdir()
    db.write_bytes(b"a store another process made first")
    assert seed_sqlite_store(db) is False
    assert db.read_bytes() == b"a store another process made first"
    assert seed_sqlite_store(tmp_path / "one" / "mlflow.db") is True
    template = next((tmp_path / "cache").glob("mlflow-*-empty.db"))
    built, seeded_at_ms = template.stat().st_mtime_ns, int(time.time() * 1000)
    assert seed_sqlite_store(tmp_path / "two" / "mlflow.db") is True
    assert template.stat().st_mtime_ns == built
    # Its Default experiment was made at its first connection, not copied from the template.
    default = MlflowClient(f"sqlite:///{tmp_path / 'two' / 'mlflow.db'}").get_experiment("0")
    assert default.creation_time >= seeded_at_ms
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["mlflow.db"]  # no temporary file left
