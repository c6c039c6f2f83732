"""Part b: elastictrain's losses equal plain PyTorch's on the same device, through Ray and `--local`.

A small Llama trained for `numerics_steps` steps at world size 1 (ZeRO-3, the profile's precision:
bf16 on the GPU) by elastictrain on a Ray actor (`num_gpus=1` on the GPU) and by `--local`, against the
plain PyTorch loop of benchmarks/reference.py on the same device. The tolerance is derived, not
guessed, as the CPU tests derive it: the reference runs twice, the global batch whole and split into
the run's accumulated micro-batches; the largest difference between those two runs (or one fp32 ulp of
the loss, if larger) is the noise of summation order, and a run must stay within 10x of it.
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.gpu_check import runs
from benchmarks.gpu_check.profile import TINY

FP32_EPS = float(torch.finfo(torch.float32).eps)


def tolerance(whole: list[float], split: list[float]) -> tuple[float, float]:
    """(noise, tolerance): the two reference runs' largest difference, and 10x it (or 10 fp32 ulps)."""
    noise = max(abs(a - b) for a, b in zip(whole, split, strict=True))
    return noise, 10 * max(noise, FP32_EPS * max(abs(v) for v in whole))


def largest_difference(losses: list[float], reference: list[float]) -> float:
    if len(losses) != len(reference):
        raise RuntimeError(f"{len(losses)} losses reported for {len(reference)} steps")
    return max(abs(a - b) for a, b in zip(losses, reference, strict=True))


def run(ctx: Any) -> None:
    from benchmarks.reference import train_reference
    from elastictrain.data.sources import dataset_from_config

    p = ctx.profile
    steps = p.numerics_steps
    common = (*p.small_model, f"training.max_steps={steps}", f"checkpoint.every_steps={steps}")
    cfg = runs.config(p, TINY, ctx.work / "ray", *common)
    accumulation = cfg.training.global_batch_size // cfg.training.micro_batch_size
    dataset = dataset_from_config(cfg)
    whole, _ = train_reference(cfg, dataset, steps, device=p.device, precision=p.precision)
    split, _ = train_reference(
        cfg, dataset, steps, micro_batches=accumulation, device=p.device, precision=p.precision
    )
    noise, tol = tolerance(whole, split)
    ctx.record("reference", {"losses": whole, "split_losses": split, "noise": noise, "tolerance": tol})
    ctx.record(
        "setting",
        {
            "hf_config": dict(cfg.model.hf_config),
            "seq_len": cfg.data.seq_len,
            "global_batch_size": cfg.training.global_batch_size,
            "accumulation": accumulation,
            "precision": p.precision,
            "zero_stage": cfg.deepspeed.zero_stage,
            "steps": steps,
            "device": p.device,
        },
    )
    for name, local in (("ray", False), ("local", True)):
        run_cfg = runs.config(p, TINY, ctx.work / name, *common)
        result = runs.train(run_cfg, local=local)
        losses = [s["loss"] for s in result["steps"]]
        diff = largest_difference(losses, whole)
        ctx.record(name, {"losses": losses, "largest_difference": diff, "wall_s": result["wall_s"]})
        ctx.target(
            f"numerics {name}: largest loss difference from plain PyTorch",
            diff,
            tol,
            "<=",
            note=f"10x the reference's own summation-order noise ({noise:.3g}) over {steps} steps",
        )
