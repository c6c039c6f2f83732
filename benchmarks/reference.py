"""The reference every numerics test compares against: a plain single-process PyTorch training loop.

No DeepSpeed, no Ray, no elastictrain engine: the model comes from transformers' `from_config` (or
`from_pretrained`), the optimizer is `torch.optim.AdamW`, clipping is `clip_grad_norm_`. What it shares
with elastictrain is only the specification of a run: the dataset a config names, which sample each
global position reads (`core.data_order.sample_at`) and the learning-rate schedule
(`core.schedule.step_learning_rate`), all pure functions of the config.

On a GPU it runs on `device`; with `precision="bf16"` it trains as DeepSpeed's bf16 mode does, written
out in plain PyTorch: the model computes in bf16 (its weights rounded from the fp32 initialization,
gradients accumulated in bf16), and an fp32 master copy of every weight takes the clipped fp32 gradients
and the AdamW update, then is rounded back into the model.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from elastictrain.core.data_order import sample_at
from elastictrain.core.schedule import step_learning_rate


def reference_model(config: Any, device: str = "cpu") -> torch.nn.Module:
    """The model a config describes, built by transformers alone with the run's seed, on `device`
    (its random init drawn there, as a worker's is drawn on its own device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if config.model.pretrained:
        return AutoModelForCausalLM.from_pretrained(config.model.pretrained, local_files_only=True).to(device)
    params = dict(config.model.hf_config)
    hf = AutoConfig.for_model(params.pop("model_type"), **params)
    torch.manual_seed(config.training.seed)  # what each elastictrain worker seeds before building
    with torch.device(device):
        return AutoModelForCausalLM.from_config(hf)


def global_batch(config: Any, dataset: Any, step: int) -> torch.Tensor:
    """Every sample of optimizer step `step`, in global-position order (the run's global batch)."""
    g = config.training.global_batch_size
    n = len(dataset)
    positions = range(step * g, (step + 1) * g)
    return torch.stack([dataset[sample_at(p, n, config.training.seed)] for p in positions])


def causal_lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def train_reference(
    config: Any,
    dataset: Any,
    steps: int,
    *,
    micro_batches: int = 1,
    device: str = "cpu",
    precision: str = "fp32",
    skipped: frozenset[int] = frozenset(),
) -> tuple[list[float], torch.nn.Module]:
    """Losses of `steps` optimizer steps, and the trained model. The steps (0-based) in `skipped` are not
    taken: their batch is left out, the optimizer's own step count does not move, their loss is NaN (a
    run skipping a non-finite step, control/bad_steps.py).

    Each global batch runs as `micro_batches` equal accumulated parts.

    Every sample holds the same number of target tokens, so the mean over equal parts is the mean over
    the global batch: changing `micro_batches` changes only the order of floating-point sums.
    """
    t = config.training
    model = reference_model(config, device)
    model.train()
    master = None
    if precision == "bf16":
        model.to(torch.bfloat16)  # DeepSpeed's fp32 master starts from the bf16 weights, as here
        master = [p.detach().float().requires_grad_(True) for p in model.parameters()]
    elif precision != "fp32":
        raise ValueError(f"precision: got {precision!r}; the reference runs fp32 or bf16")
    optimizer = torch.optim.AdamW(
        master if master is not None else model.parameters(),
        lr=t.lr,
        betas=(t.adam_beta1, t.adam_beta2),
        eps=t.adam_eps,
        weight_decay=t.weight_decay,
    )
    losses = []
    for step in range(steps):
        if step in skipped:
            losses.append(math.nan)
            continue
        lr = step_learning_rate(step, t)
        for group in optimizer.param_groups:
            group["lr"] = lr
        total = 0.0
        for part in global_batch(config, dataset, step).to(device).chunk(micro_batches):
            loss = causal_lm_loss(model, part)
            (loss / micro_batches).backward()
            total += float(loss.detach()) / micro_batches
        if master is not None:
            for p, m in zip(model.parameters(), master, strict=True):
                m.grad = p.grad.float() if p.grad is not None else None
                p.grad = None
        trained = master if master is not None else list(model.parameters())
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(trained, t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if master is not None:
            with torch.no_grad():
                for p, m in zip(model.parameters(), master, strict=True):
                    p.copy_(m)
        losses.append(total)
        assert math.isfinite(total), f"reference loss diverged at step {step}"
    return losses, model
