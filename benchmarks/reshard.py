"""Resharding a ZeRO-3 checkpoint from N=2 to M=3 ranks: elastictrain against DeepSpeed's universal route.

Source: the deepspeed-launcher baseline at world size 2 saved the same state twice, as DeepSpeed's
checkpoint and as elastictrain's fragments. At world size 3 (one torchrun job) each rank then loads
both, timed; the loss on a fixed batch after each load checks they hold the same state.
  universal route  `python -m deepspeed.checkpoint.ds_to_universal` (a subprocess, as users run it)
                   + `load_checkpoint` with `load_universal`;
  elastictrain     each new rank reads its own slices from the N-rank fragment files (no conversion);
                   the offline `reshard_checkpoint` (N files -> M files) is timed too.
Disk: sequential write (fsync'd) and read bandwidth of this disk, measured in the same run on a file
of at least the checkpoint's size.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import baselines
from benchmarks.common import (
    Result,
    Target,
    Workload,
    median,
    peer_check,
    peer_env,
    ratio,
    run_peer,
    workload_info,
)

N = 2


def target_size(smoke: bool) -> int:
    """M: 3 (a grow); smoke loads at 1, a single process being the cheapest launch."""
    return 1 if smoke else 3


def drop_from_page_cache(paths: list[Path]) -> None:
    """Make the next read of these files come from the disk (they must be written and synced)."""
    for path in paths:
        if not path.is_file():
            continue
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def disk_bandwidth(
    folder: Path, size: int, *, floor: int = 64 << 20, block_bytes: int = 8 << 20, cold: bool = False
) -> dict[str, float]:
    """Sequential write+fsync and read of `size` bytes (at least `floor`) in `block_bytes` blocks; with
    `cold`, the read comes from the disk (page cache dropped), not from memory."""
    size = max(size, floor)
    block = os.urandom(block_bytes)
    path = folder / "disk-bandwidth.bin"
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        written = 0
        while written < size:
            written += f.write(block)
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    if cold:
        drop_from_page_cache([path])
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(block_bytes):
            pass
    read_s = time.perf_counter() - t0
    path.unlink()
    return {
        "bytes": written,
        "write_fsync_bytes_per_s": written / write_s,
        "read_bytes_per_s": written / read_s,
    }


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def one_rep(w: Workload, tmp: Path, rep: int, M: int) -> dict[str, Any]:  # noqa: N803
    from elastictrain.tools.reshard import reshard_checkpoint

    src = baselines.peer("deepspeed", N, w, tmp, rep)
    save = (src.out or {})["save"]
    ds_dir = Path(save["fragments_dir"]).parent / "deepspeed"
    tag = save["deepspeed_tag"]
    fragments = Path(save["fragments_dir"])
    universal_tag = f"{tag}_universal"

    t0 = time.perf_counter()
    conv = subprocess.run(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
         "--input_folder", str(ds_dir / tag), "--output_folder", str(ds_dir / universal_tag)],
        env=peer_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    convert_s = time.perf_counter() - t0
    if conv.returncode != 0:
        raise RuntimeError(
            f"ds_to_universal failed ({conv.returncode}):\n{conv.stdout[-2000:]}\n{conv.stderr[-2000:]}"
        )

    t0 = time.perf_counter()
    reshard_checkpoint(fragments, M, tmp / f"reshard-rep{rep}" / f"fragments.ws{M}")
    offline_s = time.perf_counter() - t0

    load = run_peer(
        "torchrun",
        M,
        w,
        tmp / f"reshard-load-ws{M}-rep{rep}",
        spec_extra={
            "steps": 0,
            "load_universal": str(ds_dir),
            "load_universal_tag": universal_tag,
            "load_fragments": str(fragments),
        },
    )
    peer_check(load, f"loading the world-size-{N} checkpoints at world size {M}")
    loads = load.out["load"]  # type: ignore[index]
    frag_bytes = _bytes(fragments)
    return {
        "rep": rep,
        "deepspeed_checkpoint_bytes": _bytes(ds_dir / tag),
        "universal_bytes": _bytes(ds_dir / universal_tag),
        "fragment_bytes": frag_bytes,
        "ds_to_universal_s": convert_s,
        "universal_load_s": loads["universal_load_s"],
        "universal_route_s": convert_s + loads["universal_load_s"],
        "elastictrain_load_s": loads["fragments_load_s"],
        "elastictrain_offline_reshard_s": offline_s,
        "loss_saved_ws2": save["eval_loss"],
        "loss_universal_new_ws": loads["universal_eval_loss"],
        "loss_elastictrain_new_ws": loads["fragments_eval_loss"],
        "disk": disk_bandwidth(tmp, frag_bytes),
    }


def run(w: Workload, tmp: Path, reps: int, smoke: bool) -> Result:
    M = target_size(smoke)  # noqa: N806
    runs = []
    for rep in range(reps):
        r = one_rep(w, tmp, rep, M)
        runs.append(r)
        print(
            f"  reshard rep {rep}: universal {r['universal_route_s']:.2f}s, "
            f"elastictrain {r['elastictrain_load_s']:.3f}s",
            flush=True,
        )
    med = lambda k: median([r[k] for r in runs])  # noqa: E731
    et_s, uni_s = med("elastictrain_load_s"), med("universal_route_s")
    frag_bytes = med("fragment_bytes")
    metrics = {
        "from_world_size": N,
        "to_world_size": M,
        "universal_route_s": uni_s,
        "ds_to_universal_s": med("ds_to_universal_s"),
        "universal_load_s": med("universal_load_s"),
        "elastictrain_load_s": et_s,
        "elastictrain_offline_reshard_s": med("elastictrain_offline_reshard_s"),
        "speedup_vs_universal": ratio(uni_s, et_s),
        "speedup_vs_universal_load_only": ratio(med("universal_load_s"), et_s),
        "elastictrain_bytes_per_s": ratio(frag_bytes, et_s),
        "universal_bytes_per_s": ratio(med("deepspeed_checkpoint_bytes"), uni_s),
        "disk_write_fsync_bytes_per_s": median([r["disk"]["write_fsync_bytes_per_s"] for r in runs]),
        "disk_read_bytes_per_s": median([r["disk"]["read_bytes_per_s"] for r in runs]),
        "fragment_bytes": frag_bytes,
        "deepspeed_checkpoint_bytes": med("deepspeed_checkpoint_bytes"),
        "max_loss_difference": max(
            max(
                abs(r["loss_universal_new_ws"] - r["loss_saved_ws2"]),
                abs(r["loss_elastictrain_new_ws"] - r["loss_saved_ws2"]),
            )
            for r in runs
        ),
    }
    metrics["elastictrain_vs_disk_read"] = ratio(
        metrics["elastictrain_bytes_per_s"], metrics["disk_read_bytes_per_s"]
    )
    targets = [
        Target(
            f"reshard {N}->{M}: universal route time / elastictrain",
            metrics["speedup_vs_universal"],
            2.0,
            ">=",
        ),
    ]
    notes = [
        "ds_to_universal_s is the subprocess's wall time: a fresh interpreter importing deepspeed is part "
        "of that route as users run it; speedup_vs_universal_load_only leaves the conversion out.",
        "max_loss_difference: the loss on a fixed batch after each load against the saved state's.",
    ]
    return Result("reshard", smoke, reps, metrics, targets, runs, notes, workload_info(w))


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = result["metrics"]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.barh(["universal route"], [m["ds_to_universal_s"]], label="ds_to_universal", color="C1")
    ax.barh(
        ["universal route"],
        [m["universal_load_s"]],
        left=[m["ds_to_universal_s"]],
        label="universal load",
        color="C3",
    )
    ax.barh(["elastictrain load"], [m["elastictrain_load_s"]], label="fragment load", color="C0")
    ax.barh(
        ["elastictrain offline"], [m["elastictrain_offline_reshard_s"]], label="offline reshard", color="C9"
    )
    ax.set_xlabel(f"seconds, world size {m['from_world_size']} -> {m['to_world_size']} (median)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
