"""LoRA adapters (peft) on top of a ZeRO-3 model (the export of the adapter is tools/adapter.py).

Only the adapters are trainable, so only they enter the optimizer and the checkpoints (zero_state.py
saves what the optimizer holds). The frozen base needs no saving: it is rebuilt the same way at every
(re)start, from the pretrained folder, or from `training.seed` for a config-built or factory model
(every rank and every world size builds the same weights from the same seed).
"""

from __future__ import annotations

from typing import Any

import torch


def peft_config(lora: Any, model: torch.nn.Module) -> Any:
    from peft import LoraConfig

    is_transformers = hasattr(model, "prepare_inputs_for_generation")
    return LoraConfig(
        r=int(lora.r),
        lora_alpha=float(lora.alpha),
        lora_dropout=float(lora.dropout),
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM" if is_transformers else None,
    )


def _check_targets(model: torch.nn.Module, lora: Any) -> None:
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in lora.target_modules if t not in names]
    if missing:
        # Layers (modules without children) are what LoRA wraps: name those.
        leaves = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if n and not any(m.children())}
        raise ValueError(
            f"model.lora.target_modules: {missing} match no module of the model; its layers are named "
            f"{', '.join(sorted(n for n in leaves if not n.isdigit())[:20])}"
        )


def apply_lora(
    model: torch.nn.Module, lora: Any, *, activation_checkpointing: bool = False
) -> torch.nn.Module:
    from peft import get_peft_model

    _check_targets(model, lora)
    wrapped = get_peft_model(model, peft_config(lora, model))
    if activation_checkpointing and hasattr(wrapped, "enable_input_require_grads"):
        # With a frozen embedding, checkpointed blocks would otherwise see inputs without gradients.
        wrapped.enable_input_require_grads()
    return wrapped
