"""Checkpoint stall: seconds training is blocked by a checkpoint, against DeepSpeed's `save_checkpoint`.

elastictrain: the `checkpoint_pause` events of a world-size-2 run with checkpoints every quarter of
its steps, measured on the workers: the slowest rank's idle time before its snapshot, the snapshot,
and its idle time before the next step (the snapshot is queued behind the segment's last step and
the next steps behind it; each rank's durable write runs in a background thread,
`checkpoint.background_write`); and the `checkpoint` events' `seconds`, from queueing the snapshot
to the commit. DeepSpeed: the slowest rank's `save_checkpoint` of the same model state at the same
world size (the deepspeed-launcher baseline, after its steps), during which its training waits. The
same process also times elastictrain's synchronous save path (snapshot + fsynced write, what
`background_write: false` blocks for) and its snapshot alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import baselines
from benchmarks.common import Result, Target, Workload, median, ratio, workload_info


def run(w: Workload, tmp: Path, reps: int, smoke: bool) -> Result:
    runs: list[dict[str, Any]] = []
    for rep in range(reps):
        # Checkpoints mid-run too, so that steps follow them and their pause can be measured.
        every = max(2, w.steps // 4)
        et = baselines.elastictrain(2, w, tmp, rep, f"checkpoint.every_steps={every}")
        ds = baselines.peer("deepspeed", 2, w, tmp, rep)
        save = (ds.out or {})["save"]
        runs.append(
            {
                "rep": rep,
                "elastictrain_checkpoint_s": [p["pause_s"] for p in et.get("pauses", [])],
                "elastictrain_commit_s": [c["seconds"] for c in et["checkpoints"]],
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
        "elastictrain_commit_s": median(flat("elastictrain_commit_s")),
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
            note="training waits only for the snapshot; the fsynced write runs in the background",
        )
    ]
    notes = [
        "elastictrain_checkpoint_s: median pause of training per checkpoint, measured on the workers "
        "(slowest rank: idle before the snapshot, the snapshot, idle before the next step); "
        "elastictrain_commit_s: snapshot to committed manifest, written in the "
        "background while training goes on.",
        "elastictrain_fragment_save_s: the synchronous path (background_write: false), snapshot plus "
        "fsynced write, for comparison; DeepSpeed's save_checkpoint does not fsync.",
    ]
    return Result("checkpoint_stall", smoke, reps, metrics, targets, runs, notes, workload_info(w))


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = result["metrics"]
    labels = ["elastictrain\npause", "elastictrain\nsync write", "DeepSpeed\nsave_checkpoint"]
    keys = ("elastictrain_checkpoint_s", "elastictrain_fragment_save_s", "deepspeed_save_checkpoint_s")
    vals = [m[k] for k in keys]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar(labels, [v or 0 for v in vals], color=["C0", "C9", "C1"])
    ax.set_ylabel("seconds training is blocked (median)")
    ax.set_title("Checkpoint stall, world size 2")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
