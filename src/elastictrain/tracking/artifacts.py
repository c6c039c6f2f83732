"""Files logged to a run's MLflow run after the fact (plots, an exported model), and its system metrics.

These go to MLflow directly, not through the spool: they are files already kept in the run folder (or
the export folder), so a failed upload loses nothing; `elastictrain plot RUN_DIR` or `export
--log-to-mlflow` sends them again.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from elastictrain.rundir.run_dir import RunDir

log = logging.getLogger("elastictrain.tracking")


class NoMlflowRun(ValueError):
    """The run has no MLflow run (trained with --no-tracking, or its tracker never connected)."""


def mlflow_run(run_dir: RunDir, configured_uri: str | None) -> tuple[Any, str]:
    """(an MlflowClient for the run's store, its MLflow run id)."""
    from mlflow.tracking import MlflowClient

    from elastictrain.tracking.run_tracker import tracking_uri_of

    run_id = run_dir.read_info().mlflow_run_id
    if not run_id:
        raise NoMlflowRun(
            f"{run_dir.path} has no MLflow run (trained with --no-tracking, or MLflow never answered; "
            f"`elastictrain sync {run_dir.path}` sends what it spooled)"
        )
    return MlflowClient(tracking_uri_of(run_dir, configured_uri)), run_id


def log_files(run_dir: RunDir, configured_uri: str | None, files: list[Path], artifact_path: str) -> str:
    """Upload `files` under `artifact_path` of the run's MLflow run; returns that run's id."""
    client, run_id = mlflow_run(run_dir, configured_uri)
    for f in files:
        client.log_artifact(run_id, str(f), artifact_path)
    return run_id


def log_folder(run_dir: RunDir, configured_uri: str | None, folder: Path, artifact_path: str) -> str:
    client, run_id = mlflow_run(run_dir, configured_uri)
    client.log_artifacts(run_id, str(folder), artifact_path)
    return run_id


class SystemMetrics:
    """MLflow's system metrics monitor for the run's MLflow run, on the driver (`tracking.system_metrics`).

    Started once the MLflow run exists: at once when it does, else when the tracker's thread has
    created it (an MLflow server that answers late).
    """

    def __init__(self, config: Any, run_dir: RunDir) -> None:
        self.config, self.run_dir = config, run_dir
        self.monitor: Any = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        if config.tracking.system_metrics:
            self._thread = threading.Thread(
                target=self._start_when_run_exists, name="system-metrics", daemon=True
            )
            self._thread.start()

    def _start_when_run_exists(self) -> None:
        while not self._stop.is_set():
            info = self.run_dir.read_info()
            if info.mlflow_run_id:
                with self._lock:
                    if not self._stop.is_set():
                        self.monitor = self._monitor(info.mlflow_run_id, resume=info.last_step > 0)
                return
            self._stop.wait(1.0)

    def _monitor(self, run_id: str, *, resume: bool) -> Any:
        t = self.config.tracking
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            from elastictrain.tracking.run_tracker import tracking_uri_of

            logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # its start/stop lines
            monitor = SystemMetricsMonitor(
                run_id,
                sampling_interval=t.system_metrics_interval_s,
                resume_logging=resume,
                tracking_uri=tracking_uri_of(self.run_dir, t.uri),
            )
            monitor.start()
            return monitor
        except Exception as e:  # noqa: BLE001 - never a reason to stop training (e.g. psutil missing)
            log.warning("MLflow system metrics are off: %s", e)
            return None

    def stop(self) -> None:
        with self._lock:
            self._stop.set()
            monitor, self.monitor = self.monitor, None
        if monitor is not None:
            try:
                monitor.finish()
            except Exception as e:  # noqa: BLE001
                log.warning("stopping MLflow system metrics: %s", e)
