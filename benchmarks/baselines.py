"""The plain training runs several benchmarks read (memoized per process, so `run` launches each once).

A peer baseline runs the workload's steps and then times DeepSpeed's `save_checkpoint` against
elastictrain's fragment save of the same state; an elastictrain baseline trains through its API,
records each step as the controller reports it, its checkpoints, and its workers' peak memory.
Throughput, checkpoint stall, memory and resharding all read these.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    PeerRun,
    Workload,
    config_overrides,
    load,
    peer_check,
    record_steps,
    run_elastictrain,
    run_peer,
    worker_peak_rss,
)

_MEMO: dict[tuple[Any, ...], Any] = {}
SAVE_REPS = 2


def ensure_local_ray() -> None:
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=4,
            include_dashboard=False,
            log_to_driver=False,
            _node_ip_address="127.0.0.1",
        )


def peer(system: str, world_size: int, w: Workload, tmp: Path, rep: int) -> PeerRun:
    key = ("peer", system, world_size, w.name, rep)
    if key not in _MEMO:
        d = tmp / f"{system}-ws{world_size}-rep{rep}"
        run = run_peer(
            system, world_size, w, d, spec_extra={"save_reps": SAVE_REPS, "save_dir": str(d / "save")}
        )
        peer_check(run, f"baseline at world size {world_size}")
        _MEMO[key] = run
    return _MEMO[key]


def elastictrain(world_size: int, w: Workload, tmp: Path, rep: int, *extra: str) -> dict[str, Any]:
    """One elastictrain run at a fixed world size; a checkpoint only at the end (as the peers save)."""
    key = ("elastictrain", world_size, w.name, rep, extra)
    if key not in _MEMO:
        ensure_local_ray()
        run_path = tmp / f"elastictrain-ws{world_size}-rep{rep}{'-' + '-'.join(extra) if extra else ''}"
        cfg = load(
            config_overrides(
                w,
                run_path,
                f"scaling.min_workers={world_size}",
                f"scaling.max_workers={world_size}",
                f"checkpoint.every_steps={w.steps}",
                *extra,
            )
        )
        steps: list[dict[str, Any]] = []
        memory: list[dict[str, Any]] = []

        def hook(controller: Any) -> None:
            record_steps(steps)(controller)

            def read_memory(c: Any) -> None:
                if c.active:  # read before the actors go: /proc of their processes
                    memory.extend(worker_peak_rss(c))

            controller.callbacks.before_shutdown.append(read_memory)

        t0 = time.time()
        run_dir = run_elastictrain(cfg, hook)
        events = run_dir.read_events()
        _MEMO[key] = {
            "steps": steps,
            "checkpoints": [e for e in events if e["event"] == "checkpoint"],
            "pauses": [e for e in events if e["event"] == "checkpoint_pause"],
            "memory": memory,
            "wall_s": time.time() - t0,
            "run_dir": str(run_dir.path),
            "checkpoint_dir": _latest_checkpoint(Path(run_dir.path)),
            "setup_s": next((e.get("setup_s") for e in events if e["event"] == "attempt_started"), None),
            "setup_peak_rss_bytes": next(
                (e.get("setup_peak_rss_bytes") for e in events if e["event"] == "attempt_started"), None
            ),
        }
    return _MEMO[key]


def _latest_checkpoint(run_dir: Path) -> str | None:
    latest = run_dir / "checkpoints" / "latest"
    if not latest.exists():
        return None
    return str(run_dir / "checkpoints" / latest.read_text().strip())


def clear() -> None:
    _MEMO.clear()


def cpu_count() -> int:
    return os.cpu_count() or 1
