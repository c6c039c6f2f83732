"""The one place a run's MLflow tracker is built: spooled in its run folder, the run id recorded there.

Both the driver and `elastictrain sync` build it here, so the tracking URI goes into run.json only
without its password (redact.py), whichever of them learns the run id.
"""

from __future__ import annotations

from elastictrain.redact import redact_text
from elastictrain.rundir.run_dir import RunDir
from elastictrain.tracking.mlflow_tracker import MlflowTracker


def run_tracker(run_dir: RunDir, uri: str, experiment: str, *, start_wait_s: float = 5.0) -> MlflowTracker:
    info = run_dir.read_info()

    def record_run_id(run_id: str) -> None:
        run_dir.update(mlflow_run_id=run_id, mlflow_tracking_uri=redact_text(uri))

    return MlflowTracker(
        uri,
        experiment,
        run_name=info.name,
        run_id=info.mlflow_run_id,
        tags={"elastictrain.run_id": info.run_id},
        # Everything is spooled in the run folder first: an MLflow outage loses nothing (mlflow_tracker.py).
        spool_dir=run_dir.path,
        on_run_id=record_run_id,
        start_wait_s=start_wait_s,
    )
