"""Parts of a measured size run again on their own (`make bench ARGS="--only scale --sizes 1b
--parts reshard,recovery"`), the size's other parts kept: for a part that failed in its size's run
(at 1B the first loads met a batch that does not split over 3 ranks; the first recoveries ran out of
memory), or after a change to what it measures. Each part keeps the time of its own run; resharding is
compared with the disk measured in that run (the disk varies threefold between runs here). `checkpoint`
runs the checkpointing run again (its step, pause, commit); the steady step, the launcher's figures and
the disk stay the size run's. `throughput` runs the launcher and elastictrain's steady run again (their
steps and peaks, side by side as in the size's run); `memory` the peak per offload.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks import baselines
from benchmarks.common import Workload
from benchmarks.scale_parts import (
    cold_disk_bandwidth,
    elastictrain_recovery,
    memory_modes,
    remove_folders,
    steady_step_s,
    worker_allocator,
)
from benchmarks.scale_reshard import reshard_loads

PARTS = ("reshard", "recovery", "checkpoint", "throughput", "memory")


def remeasure(part: str, size: str, tmp: Path) -> dict[str, Any]:
    from benchmarks import scale

    nvme = tmp / "nvme"
    nvme.mkdir(parents=True, exist_ok=True)
    w = scale.workload_for(size, smoke=False)
    w = replace(w, overrides=(*w.overrides, f"deepspeed.nvme_path={nvme}"))
    if part == "checkpoint":
        out = scale.elastictrain_checkpoint_run(w, tmp)
        baselines.clear()
    elif part == "throughput":
        out = _throughput(w, tmp, nvme)
    elif part == "memory":
        out = memory_modes(w, tmp / "memory", None, smoke=False)
        baselines.clear()
    else:
        out = _reshard(w, size, tmp, nvme) if part == "reshard" else _recovery(w, size, tmp)
    out["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    print(f"  scale {size}: {part} {out}", flush=True)
    return out


def _reshard(w: Workload, size: str, tmp: Path, nvme: Path) -> dict[str, Any]:
    ds = baselines.peer("deepspeed", 2, w, tmp, 0).out or {}
    save = ds["save"]
    remove_folders(nvme / "zero_stage_3")  # the launcher's swap files
    frag_bytes = save["fragment_bytes"]
    disk = cold_disk_bandwidth(tmp, frag_bytes // 2)
    print(f"  scale {size}: disk {disk['read_bytes_per_s'] / 1e6:.0f} MB/s read", flush=True)
    peak = max((m["peak_rss_bytes"] for m in ds.get("memory", [])), default=None)
    reshard = reshard_loads(w, tmp, save, frag_bytes, peak)
    remove_folders(Path(save["fragments_dir"]).parent, tmp / "fragments.ws3", nvme / "zero_stage_3")
    baselines.clear()
    return {**reshard, "disk": disk}


def _recovery(w: Workload, size: str, tmp: Path) -> dict[str, Any]:
    try:
        return elastictrain_recovery(w, tmp / "recovery", size)
    except RuntimeError as e:  # a finding, as in the size's own run
        return {"outcome": "failed", "error": str(e)[:2000]}
    finally:
        remove_folders(tmp / "recovery")


def _throughput(w: Workload, tmp: Path, nvme: Path) -> dict[str, Any]:
    """The launcher's and elastictrain's steady steps on the same model and DeepSpeed config, one after
    the other, as the size's run measures them."""
    ds = baselines.peer("deepspeed", 2, w, tmp, 0)
    remove_folders(nvme / "zero_stage_3")
    steady = baselines.elastictrain(2, w, tmp / "steady", 0, f"checkpoint.every_steps={w.steps}")
    remove_folders(Path(steady["run_dir"]) / "checkpoints")
    baselines.clear()
    return {
        "deepspeed": {
            "step_s": steady_step_s(ds.step_records(), w),
            "peak_rss_bytes": max(m["peak_rss_bytes"] for m in (ds.out or {})["memory"]),
        },
        "elastictrain": {"step_s": steady_step_s(steady["steps"], w), "worker_allocator": worker_allocator()},
    }
