"""Part d: the ~1B preset with its optimizer offloaded to host memory, then the numerics model's with it
on NVMe (a local folder).

A few steps each: step time, the device's and the host's memory peaks (every step reports its rank's
high-water marks) against the estimate elastictrain prints at start (core.memory_estimate, through
preflight.memory_estimate). NVMe runs the small model: on the first GPU run (an H200) the 1B model's
host-offload run alone took 87 s of the part, and a second 1B set-up would not fit the check's one
9-minute call beside the other parts; what NVMe must show on a GPU (the async I/O op builds and loads,
swapped optimizer state steps) does not depend on the model's size.

DeepSpeed compiles its CPU Adam and async I/O ops on first use: the runner
starts `elastictrain build-ops` in the background when the check starts, and this part waits for it,
so the compile's time is stated apart (in gpu-check.json's `build_ops`) and not counted in a step.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from benchmarks.gpu_check import runs
from benchmarks.gpu_check.profile import TINY

OPS_DONE = "build-ops.done"  # written by the runner's background build when it ends


def wait_for_ops(work: Path, timeout_s: float) -> float:
    """Seconds waited for the background op build (the runner's work folder is this part's parent)."""
    marker = work.parent / OPS_DONE
    t0 = time.perf_counter()
    while not marker.exists() and time.perf_counter() - t0 < timeout_s:
        time.sleep(0.5)
    return time.perf_counter() - t0


def run(ctx: Any) -> None:
    from elastictrain.driver.preflight import memory_estimate

    p = ctx.profile
    steps = p.offload_steps
    ctx.record("waited_for_ops_s", wait_for_ops(ctx.work, 0.5 * p.limits["offload"]))
    for where in ("cpu", "nvme"):
        nvme = ctx.work / "nvme"
        base, model = (p.big_config, p.big_model) if where == "cpu" else (TINY, p.small_model)
        extra = [
            *model,
            f"training.max_steps={steps}",
            "training.warmup_steps=1",  # the small model's config warms up over more steps than these
            f"checkpoint.every_steps={steps + 1}",
            f"deepspeed.offload_optimizer={where}",
            # The settings the first GPU run measured (the preset's layout before it became auto).
            "deepspeed.zero_stage=3",
            "deepspeed.offload_param=none",
            "deepspeed.activation_checkpointing=true",
            "training.micro_batch_size=4",
        ]
        if where == "nvme":
            nvme.mkdir(parents=True, exist_ok=True)
            extra.append(f"deepspeed.nvme_path={nvme}")
        cfg = runs.config(p, base, ctx.work / f"run-{where}", *extra)
        estimate = memory_estimate(cfg, 1)
        with_activations = layout_need(cfg)
        result = runs.train(cfg)
        s = result["steps"]
        figures = {
            "step_s": runs.measured_intervals(s, 2, steps),
            "first_step_rank_s": s[0]["rank_step_s"] if s else None,
            "device_peak_bytes": max(x["device_peak_bytes"] for x in s),
            "host_peak_bytes": max(x["host_peak_bytes"] for x in s),
            "estimate": {
                "device_bytes": estimate.device_bytes,
                "host_bytes": estimate.host_bytes,
                "nvme_bytes": estimate.nvme_bytes,
                "text": estimate.describe(),
            },
            # The automatic layout's estimate: the states above plus the micro batch's activations (the
            # first GPU run's device peak was 2.6x the states alone).
            "layout_estimate": with_activations,
            "wall_s": result["wall_s"],
            "model": "the ~1B preset" if where == "cpu" else "the numerics model",
        }
        figures["median_step_s"] = runs.median(figures["step_s"])
        for place in ("device", "host"):
            est = figures["estimate"][f"{place}_bytes"]
            figures[f"{place}_peak_over_estimate"] = figures[f"{place}_peak_bytes"] / est if est else None
            est = with_activations[place]
            figures[f"{place}_peak_over_layout_estimate"] = (
                figures[f"{place}_peak_bytes"] / est if est else None
            )
        ctx.record(where, figures)


def layout_need(cfg: Any) -> dict[str, int]:
    """The automatic layout's estimate for this run's own settings (core/layout.py): model states and the
    micro batch's activations, on the device and on the host."""
    from elastictrain.core.layout import Layout, need
    from elastictrain.driver.layout_auto import model_shape

    ds, t = cfg.deepspeed, cfg.training
    layout = Layout(ds.zero_stage, ds.offload_optimizer, ds.offload_param, bool(ds.activation_checkpointing))
    n = need(
        model_shape(cfg),
        layout,
        1,
        int(t.micro_batch_size) * cfg.data.seq_len,
        t.precision,
        cfg.scaling.use_gpu,
    )
    return {"device": n.device, "host": n.host, "states": n.states, "activations": n.activations}
