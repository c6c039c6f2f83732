"""The scale benchmark's resharding part: a checkpoint saved at world size 2 loaded at 3, and one resharded
offline to 3 loaded at 2, each from a cold page cache, against `ds_to_universal` plus DeepSpeed's universal
load (2 -> 3). The loads run in the peer harness (benchmarks/peers/train_step.py) under torchrun."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.common import Workload, peer_check, peer_env, run_peer
from benchmarks.reshard import drop_from_page_cache


def reshard_loads(
    w: Workload, tmp: Path, save: dict[str, Any], frag_bytes: int, peak_rss_ws2: int | None = None
) -> dict[str, Any]:
    """2 -> 3 (fragments and the universal route) and 3 -> 2 (fragments), each load from a cold cache.

    Where 3 ranks of the size's configuration would not fit this machine (3 x the launcher's peak per
    rank at 2, `peak_rss_ws2`, over its memory: 350M without offload), the loads run with the optimizer
    state on NVMe, as a user would run them: the same files and bytes are read, and the load also
    writes the optimizer's slices to the swap files (so it is, if anything, slower)."""
    from elastictrain.host.memory import meminfo_bytes
    from elastictrain.tools.reshard import reshard_checkpoint

    fragments = Path(save["fragments_dir"])
    ds_dir = fragments.parent / "deepspeed"
    tag = save["deepspeed_tag"]
    t0 = time.perf_counter()
    conv = subprocess.run(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
         "--input_folder", str(ds_dir / tag), "--output_folder", str(ds_dir / f"{tag}_universal")],
        env=peer_env(), capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    convert_s = time.perf_counter() - t0 if conv.returncode == 0 else None
    three = tmp / "fragments.ws3"
    t0 = time.perf_counter()
    reshard_checkpoint(fragments, 3, three)
    offline_s = time.perf_counter() - t0
    out: dict[str, Any] = {"ds_to_universal_s": convert_s, "offline_reshard_2_to_3_s": offline_s}
    if conv.returncode != 0:  # the route that does not work at this size: why, in its own words
        out["ds_to_universal_error"] = (conv.stderr or conv.stdout)[-1500:]
    # A load runs no step: its batch only has to split over 2 and 3 ranks (the 1B preset's 4 does not).
    gbs = next(int(o.split("=")[1]) for o in w.overrides if o.startswith("training.global_batch_size="))
    batch = f"training.global_batch_size={gbs * 3 if gbs % 3 else gbs}"
    prefix = "deepspeed.offload_optimizer="
    offload = next((o.removeprefix(prefix) for o in w.overrides if o.startswith(prefix)), "none")
    total = meminfo_bytes("MemTotal") or 0
    if offload != "nvme" and peak_rss_ws2 and 3 * peak_rss_ws2 > total:
        offload, batch = "nvme", f"{batch} deepspeed.offload_optimizer=nvme"
    loading = replace(w, overrides=(*w.overrides, *batch.split()))
    # DeepSpeed's universal load does not handle optimizer state on NVMe.
    universal_load = convert_s is not None and offload != "nvme"
    if convert_s is not None and not universal_load:
        out["universal_load_error"] = "not run: the loads need the optimizer on NVMe here"
    for src, ws, universal in ((fragments, 3, universal_load), (three, 2, False)):
        drop_from_page_cache([*src.rglob("*"), *(ds_dir.rglob("*") if universal else [])])
        extra: dict[str, Any] = {"steps": 0, "load_fragments": str(src)}
        if universal:
            extra.update(load_universal=str(ds_dir), load_universal_tag=f"{tag}_universal")
        load = run_peer("torchrun", ws, loading, tmp / f"load-ws{ws}", spec_extra=extra)
        peer_check(load, f"loading a checkpoint at world size {ws}")
        loads = load.out["load"]  # type: ignore[index]
        key = f"{'2_to_3' if ws == 3 else '3_to_2'}"
        out[f"load_{key}_s"] = loads["fragments_load_s"]
        if universal:
            out["universal_load_2_to_3_s"] = loads["universal_load_s"]
    out["bytes"] = frag_bytes
    out["load_offload_optimizer"] = offload
    return out
