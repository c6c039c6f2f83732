"""Parts c and e: throughput and MFU of the ~1B preset against plain DeepSpeed, and checkpoint costs.

The ~1B Llama of conf/gpu-llama-1b.yaml (bf16, ZeRO-3, no offload, activation checkpointing) trained at
world size 1 by elastictrain on a Ray actor and by the plain DeepSpeed script (benchmarks/peers/
train_step.py under torchrun: same model build, DeepSpeed config and batches), one after the other in
this process's lifetime. A step's time is the wall time between two completed steps as each system sees
them; the first `warmup_steps` are skipped by both.

Model FLOPs per token: 6 x (parameters less the input embedding) + 12 x layers x hidden x sequence
(attention's score and value products), PaLM's accounting as torchtitan uses it; activation
checkpointing's recomputation is not counted (it is not model work). MFU is against the profile's peak.

Part e rides on the same two runs (a 1B model's set-up is the dearest thing on the machine): elastictrain
takes a checkpoint after the last measured step with its default settings (a copy to host memory beside
the next step, written in the background), whose pause and time to commit its events record; the plain
script times one DeepSpeed `save_checkpoint` of the same state. The pause alone understates the cost:
the step after the checkpoint waits for the copy (or, where no copy fits, for the write), so the training
time a checkpoint costs is its pause plus how much longer that step took than the median step. The first
GPU run measured a 0.02 s pause and a 35 s step after it, against DeepSpeed's 17 s save.
"""

from __future__ import annotations

from typing import Any

from benchmarks.gpu_check import plain_deepspeed, runs


def flops_per_token(cfg: Any) -> tuple[float, int]:
    """(model FLOPs per trained token, parameters)."""
    from elastictrain.driver.preflight import model_size

    sizes, _ = model_size(cfg)
    hf = cfg.model.hf_config
    params = sum(sizes)
    dense = params - int(hf["vocab_size"]) * int(hf["hidden_size"])  # the input embedding is a lookup
    attention = 12 * int(hf["num_hidden_layers"]) * int(hf["hidden_size"]) * int(cfg.data.seq_len)
    return float(6 * dense + attention), params


def _event(events: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    return next((e for e in reversed(events) if e.get("event") == name), None)


def run(ctx: Any) -> None:
    p = ctx.profile
    n = p.warmup_steps + p.measured_steps
    first = p.warmup_steps + 1
    # elastictrain checkpoints after step n; step n + 1 carries its copy or write and is measured apart;
    # step n + 2 keeps the run's final checkpoint out of step n + 1.
    extra = (*p.big_model, f"training.max_steps={n + 2}", f"checkpoint.every_steps={n}")
    cfg = runs.config(p, p.big_config, ctx.work / "elastictrain", *extra)
    per_token, params = flops_per_token(cfg)
    tokens_per_step = cfg.training.global_batch_size * cfg.data.seq_len
    ctx.record(
        "setting",
        {
            "config": p.big_config.name,
            "parameters": params,
            "flops_per_token": per_token,
            "tokens_per_step": tokens_per_step,
            "global_batch_size": cfg.training.global_batch_size,
            "micro_batch_size": cfg.training.micro_batch_size,
            "seq_len": cfg.data.seq_len,
            "precision": p.precision,
            "activation_checkpointing": cfg.deepspeed.activation_checkpointing,
            "measured_steps": f"{first}..{n}",
            "peak_flops": p.peak_flops,
        },
    )

    def figures(intervals: list[float]) -> dict[str, Any]:
        step_s = runs.median(intervals)
        tps = tokens_per_step / step_s if step_s else None
        mfu = tps * per_token / p.peak_flops if tps and p.peak_flops else None
        return {"step_s": intervals, "median_step_s": step_s, "tokens_per_s": tps, "mfu": mfu}

    plain = plain_deepspeed.run(
        p,
        p.big_config,
        runs.overrides(p, ctx.work / "plain-run", *extra),
        n,
        ctx.work / "deepspeed",
        timeout_s=0.45 * p.limits["throughput"],
        deepspeed_save_dir=str(ctx.work / "deepspeed-save"),
    )
    ds = figures(runs.measured_intervals(plain["steps"], first, n))
    ds["memory"] = plain["out"].get("memory")
    ds["setup_s"] = plain["out"].get("setup_s")
    ctx.record("deepspeed", ds)

    et_run = runs.train(cfg)
    et = figures(runs.measured_intervals(et_run["steps"], first, n))
    et["device_peak_bytes"] = max(s["device_peak_bytes"] for s in et_run["steps"])
    et["host_peak_bytes"] = max(s["host_peak_bytes"] for s in et_run["steps"])
    started = _event(et_run["events"], "attempt_started") or {}
    et["setup_s"] = started.get("setup_s")
    ctx.record("elastictrain", et)
    ratio = et["tokens_per_s"] / ds["tokens_per_s"] if et["tokens_per_s"] and ds["tokens_per_s"] else None
    ctx.target("throughput: elastictrain / plain DeepSpeed (tokens/s)", ratio, 0.97, ">=")
    if et["mfu"] is not None:
        ctx.record("mfu", {"elastictrain": et["mfu"], "deepspeed": ds["mfu"], "peak_flops": p.peak_flops})

    pauses = [e for e in et_run["events"] if e.get("event") == "checkpoint_pause"]
    commits = [e for e in et_run["events"] if e.get("event") == "checkpoint"]
    pause, commit = (pauses[0] if pauses else {}), (commits[0] if commits else {})  # step n's, not the final
    after = runs.measured_intervals(et_run["steps"], n + 1, n + 1)
    lost = checkpoint_cost(pause.get("pause_s"), after[0] if after else None, et["median_step_s"])
    ds_save = plain["out"].get("deepspeed_save_checkpoint_s")
    ctx.record(
        "checkpoint",
        {
            "elastictrain_pause_s": pause.get("pause_s"),
            "elastictrain_step_after_s": after[0] if after else None,
            "elastictrain_training_lost_s": lost,
            "elastictrain_commit_after_step_s": commit.get("seconds"),
            "elastictrain_bytes": commit.get("bytes"),
            "deepspeed_save_checkpoint_s": ds_save,
            "deepspeed_bytes": plain["out"].get("deepspeed_checkpoint_bytes"),
            "events": {"pause": pause, "commit": commit},  # every field each event carries
        },
    )
    ctx.record("host_copy", host_copy_rates(2**31 if p.use_gpu else 2**24))
    if lost is not None and ds_save:
        ctx.target(
            "checkpoint: training time elastictrain loses / DeepSpeed's save_checkpoint",
            lost / ds_save,
            1.0,
            "<=",
            note="pause + the step after's excess over the median step, against DeepSpeed's blocking save",
        )


def checkpoint_cost(
    pause_s: float | None, step_after_s: float | None, median_step_s: float | None
) -> float | None:
    """Training time a checkpoint costs: its pause, plus how much longer the step after it took than the
    median step (that step waits for the checkpoint's copy, or its write where no copy fits)."""
    if pause_s is None or step_after_s is None or median_step_s is None:
        return None
    return pause_s + max(0.0, step_after_s - median_step_s)


def host_copy_rates(nbytes: int) -> dict[str, Any]:
    """What a checkpoint's copy of GPU state to host memory costs here, in GB/s: allocating pinned memory,
    copying into it (twice: the second reuses it), and allocating and copying into pageable memory. Says
    which part of a slow checkpoint copy is the allocation (the first GPU run's step after a checkpoint of
    11 GB took 35 s)."""
    import time

    import torch

    if not torch.cuda.is_available():
        return {"not_measured": "no GPU"}
    src = torch.ones(nbytes // 4, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()

    def rate(work: Any) -> float:
        t0 = time.perf_counter()
        work()
        torch.cuda.synchronize()
        return nbytes / (time.perf_counter() - t0) / 1e9

    held: dict[str, torch.Tensor] = {}
    out = {"bytes": nbytes}
    out["pinned_alloc_gb_s"] = rate(
        lambda: held.update(pinned=torch.empty_like(src, device="cpu", pin_memory=True))
    )
    out["pinned_copy_gb_s"] = rate(lambda: held["pinned"].copy_(src))
    out["pinned_copy_again_gb_s"] = rate(lambda: held["pinned"].copy_(src))
    out["pageable_alloc_and_copy_gb_s"] = rate(lambda: held.update(pageable=src.to("cpu")))
    return out
