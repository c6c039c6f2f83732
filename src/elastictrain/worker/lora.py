"""LoRA adapters (peft) on top of a ZeRO-3 model, and the adapter's export at the end of a run.

Only the adapters are trainable, so only they enter the optimizer and the checkpoints (zero_state.py
saves what the optimizer holds). The frozen base needs no saving: it is rebuilt the same way at every
(re)start, from the pretrained folder, or from `training.seed` for a config-built or factory model
(every rank and every world size builds the same weights from the same seed).
"""

from __future__ import annotations

import json
from pathlib import Path
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


def check_targets(config: Any) -> None:
    """On the driver, before workers start: every LoRA target names modules of the model (built empty)."""
    from accelerate import init_empty_weights

    from elastictrain.worker.model import forget_hf_deepspeed_config
    from elastictrain.worker.user_code import UserCodeError

    forget_hf_deepspeed_config()
    with init_empty_weights():
        model = _base_structure(config)
    try:
        _check_targets(model, config.model.lora)
    except ValueError as e:
        raise UserCodeError(str(e)) from None


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


def export_adapter(config: Any, checkpoint: Path, out_dir: Path) -> list[Path]:
    """Write the checkpoint's adapter in peft's layout (adapter_config.json + adapter_model.safetensors).

    The model is built on the meta device (no memory for the base weights) just to give peft the
    structure; the adapter weights come from the checkpoint's fragments.
    """
    from elastictrain.checkpoint.store import MANIFEST
    from elastictrain.checkpoint.zero_state import FragmentReader

    manifest = json.loads((checkpoint / MANIFEST).read_text())
    reader = FragmentReader(
        [checkpoint / f["name"] for f in manifest["files"] if f["name"].endswith(".safetensors")]
    )
    from accelerate import init_empty_weights  # a peft dependency

    from elastictrain.worker.model import forget_hf_deepspeed_config

    forget_hf_deepspeed_config()  # a local run's finished worker may have left it set in this process
    with init_empty_weights():  # parameters on the meta device, buffers real (some inits need them)
        wrapped = apply_lora(_base_structure(config), config.model.lora)
    expected = {n for n, p in wrapped.named_parameters() if p.requires_grad}
    if expected != set(reader.params):
        raise ValueError(
            f"{checkpoint}: its parameters do not match the adapters of this config "
            f"(only in checkpoint: {sorted(set(reader.params) - expected)[:3]}, "
            f"only in model: {sorted(expected - set(reader.params))[:3]})"
        )
    state = {name: reader.full(name).contiguous() for name in sorted(reader.params)}
    if config.model.pretrained:
        wrapped.peft_config["default"].base_model_name_or_path = str(Path(config.model.pretrained).resolve())
    out_dir.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(str(out_dir), state_dict=state)
    return [out_dir / "adapter_config.json", out_dir / "adapter_model.safetensors"]


def _base_structure(config: Any) -> torch.nn.Module:
    from elastictrain.worker.model import build_causal_lm

    m = config.model
    if m.factory:
        from elastictrain.worker.user_code import user_model

        return user_model(config)
    if m.pretrained:
        from transformers import AutoConfig, AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(m.pretrained))
    return build_causal_lm(dict(m.hf_config))
