"""Parts c and e: the MFU ladder at 1B against plain DeepSpeed, and checkpoint costs.

The ~1B Llama of conf/gpu-llama-1b.yaml (bf16, seq 2048) trained at world size 1 by elastictrain on a Ray
actor and by the plain DeepSpeed script (benchmarks/peers/train_step.py under torchrun: same model build,
DeepSpeed config and batches), one after the other, on each rung of a ladder of layouts:

1. the automatic choice (core/layout.py) for this device, resolved as the driver resolves it;
2. the preset before the choice existed: ZeRO-3, activation checkpointing, micro batch 4;
3. the settings the choice passed over, or where it passed over none (its first setting fitted), its
   neighbours: the choice with activation checkpointing, and ZeRO-3 at the choice's micro batch;
4. the choice with `model.compile: true` (torch.compile).

Rungs run in that order while the part's time lasts (each records as it ends; one the time cannot hold is
recorded `not_measured`). A step's time is the wall time between two completed steps as each system sees
them; the first `warmup_steps` are skipped by both, `measured_steps` (20 on the GPU) follow.

Model FLOPs per token: 6 x (parameters less the input embedding) + 12 x layers x hidden x sequence
(attention's score and value products), PaLM's accounting as torchtitan uses it; activation
checkpointing's recomputation is not counted (it is not model work). MFU is against the profile's peak.

Part e rides on the first rung's two runs (a 1B model's set-up is the dearest thing on the machine):
elastictrain takes a checkpoint after the last measured step with its default settings (a copy to host
memory beside the next step, written in the background), whose pause and time to commit its events
record; the plain script times one DeepSpeed `save_checkpoint` of the same state. The pause alone
understates the cost: the step after the checkpoint waits for the copy (or, where no copy fits, for the
write), so the training time a checkpoint costs is its pause plus how much longer that step took than the
median step. The first GPU run measured a 0.02 s pause and a 35 s step after it, against DeepSpeed's 17 s
save.
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


LAYOUT_FIELDS = ("zero_stage", "offload_optimizer", "offload_param", "activation_checkpointing")
BEFORE = {
    "zero_stage": 3,
    "offload_optimizer": "none",
    "offload_param": "none",
    "activation_checkpointing": True,
    "micro_batch_size": 4,
}


def _overrides(layout: dict[str, Any]) -> list[str]:
    out = [f"deepspeed.{k}={str(layout[k]).lower()}" for k in LAYOUT_FIELDS]
    out.append(f"training.micro_batch_size={layout['micro_batch_size']}")
    return out + (["model.compile=true"] if layout.get("compile") else [])


def rungs(cfg: Any) -> list[tuple[str, dict[str, Any], list[str]]]:
    """(name, layout, the choice's estimate lines) of each rung, in the order they run."""
    from dataclasses import asdict

    from elastictrain.driver.layout_auto import choose_at_start, rank_memory_here

    choice, _ = choose_at_start(cfg, rank_memory_here(cfg))  # the check runs one rank: min_workers 1
    chosen = asdict(choice.layout)
    out = [("auto", chosen, choice.lines()), ("before", dict(BEFORE), [])]
    # Those that fit with fewer tokens a pass than the choice wants (the others would not fit at all).
    passed = [asdict(x) for x, why in choice.passed_over if "only micro batch" in why]
    if not passed:
        passed = [{**chosen, "activation_checkpointing": True}, {**chosen, "zero_stage": 3}]
    seen = [chosen, BEFORE]
    passed.append({**chosen, "compile": True})  # torch.compile on the choice: last, if time is left
    for layout in passed:
        if layout not in seen:
            name = ", ".join(
                f"{k}={layout[k]}" for k in (*LAYOUT_FIELDS, "micro_batch_size", "compile") if k in layout
            )
            out.append((name, layout, []))
            seen.append(layout)
    return out


def run(ctx: Any) -> None:
    import time

    p = ctx.profile
    t_start = time.perf_counter()
    n = p.warmup_steps + p.measured_steps
    first = p.warmup_steps + 1
    # elastictrain checkpoints after step n on the first rung; step n + 1 carries its copy or write and is
    # measured apart; step n + 2 keeps the run's final checkpoint out of step n + 1.
    base = (*p.big_model, f"training.max_steps={n}", f"checkpoint.every_steps={10 * n}")
    auto = [f"deepspeed.{k}=auto" for k in LAYOUT_FIELDS] + ["training.micro_batch_size=auto"]
    probe = runs.config(p, p.big_config, ctx.work / "choice", *base, *auto)
    per_token, params = flops_per_token(probe)
    tokens_per_step = probe.training.global_batch_size * probe.data.seq_len
    ladder = rungs(probe)
    ctx.record(
        "setting",
        {
            "config": p.big_config.name,
            "parameters": params,
            "flops_per_token": per_token,
            "tokens_per_step": tokens_per_step,
            "global_batch_size": probe.training.global_batch_size,
            "seq_len": probe.data.seq_len,
            "precision": p.precision,
            "measured_steps": f"{first}..{n}",
            "peak_flops": p.peak_flops,
            "peak_flops_source": "H100/H200 SXM dense bf16 tensor-core peak (NVIDIA datasheet)",
            "choice": ladder[0][2],
            "rungs": [name for name, _, _ in ladder],
        },
    )

    def figures(intervals: list[float]) -> dict[str, Any]:
        step_s = runs.median(intervals)
        tps = tokens_per_step / step_s if step_s else None
        mfu = tps * per_token / p.peak_flops if tps and p.peak_flops else None
        return {"step_s": intervals, "median_step_s": step_s, "tokens_per_s": tps, "mfu": mfu}

    results: dict[str, Any] = {}
    rung_s: list[float] = []
    for index, (name, layout, _) in enumerate(ladder):
        left = p.limits["throughput"] - (time.perf_counter() - t_start)
        if rung_s and left < 1.2 * max(rung_s):
            results[name] = {"layout": layout, "not_measured": f"{left:.0f}s left of the part's limit"}
            ctx.record("ladder", results)
            continue
        t0 = time.perf_counter()
        checkpoint = index == 0
        extra = (*base, *_overrides(layout))
        if checkpoint:
            extra = (*extra, f"training.max_steps={n + 2}", f"checkpoint.every_steps={n}")
        plain = plain_deepspeed.run(
            p,
            p.big_config,
            runs.overrides(p, ctx.work / f"plain-{index}", *extra),
            n,
            ctx.work / f"deepspeed-{index}",
            timeout_s=max(30.0, 0.5 * left),
            **({"deepspeed_save_dir": str(ctx.work / "deepspeed-save")} if checkpoint else {}),
        )
        ds = figures(runs.measured_intervals(plain["steps"], first, n))
        ds["memory"] = plain["out"].get("memory")
        et_run = runs.train(runs.config(p, p.big_config, ctx.work / f"elastictrain-{index}", *extra))
        et = figures(runs.measured_intervals(et_run["steps"], first, n))
        et["device_peak_bytes"] = max(s["device_peak_bytes"] for s in et_run["steps"])
        et["host_peak_bytes"] = max(s["host_peak_bytes"] for s in et_run["steps"])
        ratio = et["tokens_per_s"] / ds["tokens_per_s"] if et["tokens_per_s"] and ds["tokens_per_s"] else None
        results[name] = {"layout": layout, "deepspeed": ds, "elastictrain": et, "ratio": ratio}
        ctx.record("ladder", results)
        ctx.target(f"throughput on rung {name}: elastictrain / plain DeepSpeed (tokens/s)", ratio, 0.97, ">=")
        if name == "auto" and et["mfu"] is not None:
            ctx.target(
                "MFU of the automatic choice (elastictrain)",
                et["mfu"],
                0.40,
                ">=",
                note=f"against {p.peak_flops:.4g} FLOP/s",
            )
        if checkpoint:
            ctx.record("deepspeed", ds)
            ctx.record("elastictrain", et)
            _checkpoint_figures(ctx, plain, et_run, et, n)
        rung_s.append(time.perf_counter() - t0)
    ctx.record("host_copy", host_copy_rates(2**31 if p.use_gpu else 2**24))


def _checkpoint_figures(
    ctx: Any, plain: dict[str, Any], et_run: dict[str, Any], et: dict[str, Any], n: int
) -> None:
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
