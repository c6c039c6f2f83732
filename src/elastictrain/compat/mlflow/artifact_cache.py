"""MLflow's per-process cache of artifact locations, emptied when a run's store has moved."""

from __future__ import annotations

from elastictrain.compat.registry import patch


def _check() -> str | None:
    from mlflow.tracking._tracking_service import utils

    cache = getattr(utils, "_artifact_repos_cache", None)
    return None if callable(getattr(cache, "clear", None)) else "mlflow has no _artifact_repos_cache to clear"


@patch(
    "mlflow_artifact_cache_cleared",
    package="mlflow",
    tested=">=2.16",
    kind="correctness",
    check=_check,
    gains=(
        "correctness: a resume in the same process after a run folder moved writes artifacts to the new place"
    ),
)
def clear_artifact_locations() -> None:
    """Forget MLflow's cached artifact location of every run in this process.

    What: empties `mlflow.tracking._tracking_service.utils._artifact_repos_cache`.
    Why: after a run folder is moved (its store's artifact locations rewritten), a resume inside the same
    process would otherwise write artifacts to the old location.
    Retired by: MLflow keying that cache on the artifact URI read from the store, or a public way to
    clear it; no upstream issue found.
    """
    from mlflow.tracking._tracking_service import utils

    utils._artifact_repos_cache.clear()
