"""Ray's background loops that no test reads, slowed for every cluster the suite starts.

An idle Ray cluster spends about 4% of a core on loops no test looks at: the dashboard agent's node
stats (psutil over every process, every 5 s), the autoscaler monitor's update (every 5 s; nothing in the
suite autoscales) and the log monitor's scan of the log folder (a glob every 0.1 s below 1000 files;
with the threshold at 0 it scans every 0.5 s, so a new worker's lines still reach its driver). The
suite's clusters live for minutes, the shared local cluster for the whole session. Logs, resources and
scheduling are untouched.
"""

from __future__ import annotations

import os

QUIET_RAY = {
    "REPORTER_UPDATE_INTERVAL_MS": "600000",
    "AUTOSCALER_UPDATE_INTERVAL_S": "600",
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
}


def quiet_ray_background_loops() -> None:
    """Set QUIET_RAY in this process's environment (before any cluster starts: the tests' clusters and
    those of the commands they run inherit it); a value already set is kept."""
    for name, value in QUIET_RAY.items():
        os.environ.setdefault(name, value)
