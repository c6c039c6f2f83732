"""The checkpoint's own model, built offline from its record and fragments: what an export must equal.

- the full model: the recorded transformers class and config, every parameter from the fragments;
- a LoRA run's model: the base from its pretrained folder, wrapped by peft with the recorded LoRA
  config, the adapters from the fragments (only they were trained and saved).
Each is built in float32 on the CPU, as the fragments hold float32 master weights.
"""

from __future__ import annotations

from typing import Any

import torch

from elastictrain.checkpoint.model_record import ModelRecord, transformers_config


def model_class(record: ModelRecord) -> Any:
    """The recorded transformers class (else the causal LM class of the config's model type)."""
    import transformers

    found = getattr(transformers, record.architecture or "", None)
    if isinstance(found, type) and hasattr(found, "from_pretrained"):
        return found
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM


def _build(record: ModelRecord) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from elastictrain.compat.transformers.preload import model_from_config

    cls, config = model_class(record), transformers_config(record)
    return (
        AutoModelForCausalLM.from_config(config)
        if cls is AutoModelForCausalLM
        else model_from_config(cls, config)
    )


def structure(record: ModelRecord) -> torch.nn.Module:
    """The model's structure on the meta device (no memory): its parameter names, shapes and order."""
    with torch.device("meta"):
        return _build(record)


def parameter_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Each parameter once (a tied pair under its first name, as the checkpoint saves it), in module order."""
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def check_same_parameters(model_params: set[str], saved: set[str], what: str) -> None:
    if model_params != saved:
        raise ValueError(
            f"the checkpoint's parameters are not those of {what} (only in the checkpoint: "
            f"{sorted(saved - model_params)[:3]}, only in the model: {sorted(model_params - saved)[:3]})"
        )


def full_model(record: ModelRecord, reader: Any) -> torch.nn.Module:
    """The checkpoint's model in float32: built without computing an init, every parameter read in."""
    from elastictrain.compat.transformers.hf_init import skip_parameter_init

    with skip_parameter_init():  # the fragments overwrite every parameter; buffers are still computed
        model = _build(record)
    params = dict(model.named_parameters())
    check_same_parameters(set(params), set(reader.params), f"{record.architecture} (the recorded model)")
    with torch.no_grad():
        for name, p in params.items():
            p.data = reader.full(name).to(p.device)
    return model.float().eval()


def lora_config(record: ModelRecord) -> Any:
    from peft import PeftConfig

    assert record.peft is not None, "not a LoRA run"
    # peft names the base from the model it wraps; a recorded name would only make it warn of the change.
    return PeftConfig.from_peft_type(**{**record.peft, "base_model_name_or_path": None})


def pretrained_base(record: ModelRecord) -> torch.nn.Module:
    """A LoRA run's frozen base, from its pretrained folder, in float32."""
    from pathlib import Path

    if not record.pretrained:
        raise ValueError(
            f"the run's base model was built from model.{record.source}, not loaded from a folder: its "
            "weights are in no file, so the adapter cannot be merged into it nor checked against it"
        )
    if not (Path(record.pretrained) / "config.json").is_file():
        raise ValueError(
            f"model.pretrained: the run's base model {record.pretrained} is gone (no config.json); "
            "the adapter needs it to be merged or checked: put the folder back at that path"
        )
    model = model_class(record).from_pretrained(record.pretrained, dtype=torch.float32, local_files_only=True)
    return model.eval()


def lora_model(record: ModelRecord, reader: Any, base: torch.nn.Module) -> Any:
    """The run's model: `base` wrapped by peft as in training, its adapters read from the fragments."""
    from peft import get_peft_model

    wrapped = get_peft_model(base, lora_config(record))
    trainable = {n: p for n, p in wrapped.named_parameters() if p.requires_grad}
    check_same_parameters(set(trainable), set(reader.params), "the recorded LoRA adapters")
    with torch.no_grad():
        for name, p in trainable.items():
            p.copy_(reader.full(name))
    return wrapped.eval()
