"""Export of a LoRA run's adapter in peft's layout, from a committed checkpoint (offline, on the driver).

Two callers: the run's end (`export_adapter`, from the run's config, into model.lora.export_dir) and
`elastictrain export` (`adapter_from_record`, from the checkpoint's own record of the model).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from elastictrain.model.lora import apply_lora


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
    with _empty_weights():
        wrapped = apply_lora(base_structure(config), config.model.lora)
    base = str(Path(config.model.pretrained).resolve()) if config.model.pretrained else None
    return write_adapter(wrapped, reader, out_dir, base, torch.float32)


def adapter_from_record(record: Any, reader: Any, out_dir: Path, dtype: torch.dtype) -> list[Path]:
    """The adapter of a checkpoint whose manifest records the model (checkpoint/model_record.py)."""
    from peft import get_peft_model

    from elastictrain.tools.export_models import lora_config, structure

    with _empty_weights():
        wrapped = get_peft_model(structure(record), lora_config(record))
    return write_adapter(wrapped, reader, out_dir, record.pretrained, dtype)


def write_adapter(
    wrapped: Any, reader: Any, out_dir: Path, base: str | None, dtype: torch.dtype
) -> list[Path]:
    """peft's save_pretrained of `wrapped` (a structure), with the adapter weights of the fragments.

    `base`: the base model's folder, named in adapter_config.json (None: a base built from a config).
    """
    expected = {n for n, p in wrapped.named_parameters() if p.requires_grad}
    if expected != set(reader.params):
        raise ValueError(
            f"the checkpoint's parameters do not match the adapters of this config "
            f"(only in checkpoint: {sorted(set(reader.params) - expected)[:3]}, "
            f"only in model: {sorted(expected - set(reader.params))[:3]})"
        )
    state = {name: reader.full(name).to(dtype).contiguous() for name in sorted(reader.params)}
    wrapped.peft_config["default"].base_model_name_or_path = base
    out_dir.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(str(out_dir), state_dict=state)
    return [out_dir / "adapter_config.json", out_dir / "adapter_model.safetensors"]


def _empty_weights() -> Any:
    """Parameters on the meta device, buffers real (some inits need them), in this thread only."""
    from elastictrain.model.build import forget_hf_deepspeed_config
    from elastictrain.model.empty import empty_weights

    forget_hf_deepspeed_config()  # a local run's finished worker may have left it set in this process
    return empty_weights()


def base_structure(config: Any) -> torch.nn.Module:
    """The model of this config as built before LoRA wraps it (on the caller's device context)."""
    from elastictrain.model.build import build_causal_lm

    m = config.model
    if m.factory:
        from elastictrain.user_code import user_model

        return user_model(config)
    if m.pretrained:
        from elastictrain.compat.transformers.preload import import_modeling_code

        import_modeling_code()
        from transformers import AutoConfig, AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(m.pretrained))
    return build_causal_lm(dict(m.hf_config))
