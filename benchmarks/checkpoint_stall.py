"""Checkpoint stall: seconds training is blocked by a checkpoint, against DeepSpeed's `save_checkpoint`.

elastictrain: the controller's `checkpoint` event of the world-size-2 baseline run (steps stop for all
of it: snapshot, durable write of each rank's fragments, manifest, commit). DeepSpeed: the slowest
rank's `save_checkpoint` of the same model state at the same world size (the deepspeed-launcher
baseline, after its steps). The same process also times elastictrain's per-rank save path alone
(snapshot + durable write) and its snapshot alone, which is all an asynchronous save would block.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import baselines
from benchmarks.common import Result, Target, Workload, median, ratio, workload_info


def run(w: Workload, tmp: Path, reps: int, smoke: bool) -> Result:
    runs: list[dict[str, Any]] = []
    for rep in range(reps):
        et = baselines.elastictrain(2, w, tmp, rep)
        ds = baselines.peer("deepspeed", 2, w, tmp, rep)
        save = (ds.out or {})["save"]
        runs.append(
            {
                "rep": rep,
                "elastictrain_checkpoint_s": [c["seconds"] for c in et["checkpoints"]],
                "elastictrain_checkpoint_bytes": [c.get("bytes") for c in et["checkpoints"]],
                "deepspeed_save_checkpoint_s": save["deepspeed_save_checkpoint_s"],
                "deepspeed_bytes": save["deepspeed_bytes"],
                "fragment_save_s": save["elastictrain_save_s"],
                "snapshot_s": save["elastictrain_snapshot_s"],
            }
        )
    flat = lambda k: [v for r in runs for v in r[k] if v is not None]  # noqa: E731
    et_s, ds_s = median(flat("elastictrain_checkpoint_s")), median(flat("deepspeed_save_checkpoint_s"))
    metrics = {
        "elastictrain_checkpoint_s": et_s,
        "deepspeed_save_checkpoint_s": ds_s,
        "elastictrain_fragment_save_s": median(flat("fragment_save_s")),
        "elastictrain_snapshot_s": median(flat("snapshot_s")),
        "elastictrain_checkpoint_bytes": median(flat("elastictrain_checkpoint_bytes")),
        "deepspeed_checkpoint_bytes": median([r["deepspeed_bytes"] for r in runs if r["deepspeed_bytes"]]),
        "stall_ratio": ratio(et_s, ds_s),
        "snapshot_ratio": ratio(median(flat("snapshot_s")), ds_s),
    }
    targets = [
        Target(
            "checkpoint stall: elastictrain / DeepSpeed save_checkpoint",
            metrics["stall_ratio"],
            0.10,
            "<=",
            note="elastictrain's save is synchronous and fsyncs every file; DeepSpeed's writes to the page "
            "cache without fsync",
        )
    ]
    notes = [
        "elastictrain_snapshot_s: copying this rank's fragments to host memory, the part of a save an "
        "asynchronous writer would still block; snapshot_ratio compares it with DeepSpeed's save.",
    ]
    return Result("checkpoint_stall", smoke, reps, metrics, targets, runs, notes, workload_info(w))


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = result["metrics"]
    labels = ["elastictrain\ncheckpoint", "elastictrain\nsnapshot only", "DeepSpeed\nsave_checkpoint"]
    vals = [m["elastictrain_checkpoint_s"], m["elastictrain_snapshot_s"], m["deepspeed_save_checkpoint_s"]]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar(labels, [v or 0 for v in vals], color=["C0", "C9", "C1"])
    ax.set_ylabel("seconds training is blocked (median)")
    ax.set_title("Checkpoint stall, world size 2")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
