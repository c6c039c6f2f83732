"""What `auto` layout fields (deepspeed.zero_stage, offload_*, activation_checkpointing,
training.micro_batch_size) need of the rest of the config: checked when the config loads."""

from __future__ import annotations

from typing import Any

AUTO = "auto"
# model.attn_implementation's values: transformers' names, and auto (model/build.attention_kernel)
ATTENTION_KERNELS = ["auto", "eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention"]
DEEPSPEED_FIELDS = ("zero_stage", "offload_optimizer", "offload_param", "activation_checkpointing")


def auto_fields(config: Any) -> list[str]:
    """The dotted names of the layout fields set to auto."""
    ds = config.deepspeed
    names = [f"deepspeed.{f}" for f in DEEPSPEED_FIELDS if getattr(ds, f) == AUTO]
    return names + (["training.micro_batch_size"] if config.training.micro_batch_size == AUTO else [])


def micro_batch_cap(config: Any) -> int:
    """The micro batch's upper bound for working out which world sizes split the global batch: with auto,
    any divisor may be chosen."""
    t = config.training
    return int(t.global_batch_size if t.micro_batch_size == AUTO else t.micro_batch_size)


def auto_layout_problems(config: Any) -> list[str]:
    fields = auto_fields(config)
    if not fields:
        return []
    p = []
    zero_auto = [f for f in fields if f.startswith("deepspeed.")]
    if zero_auto and config.deepspeed.config_file:
        p.append(
            f"{zero_auto[0]}: got 'auto' with deepspeed.config_file; your JSON's zero_optimization decides "
            "the layout there: set the field to a value, or remove config_file"
        )
    if config.model.factory:
        p.append(
            f"{fields[0]}: got 'auto' with model.factory; the choice estimates a transformers decoder's "
            "activations, so it needs model.hf_config or model.pretrained: give the field a value"
        )
    return p
