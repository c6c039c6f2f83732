"""model.attn_implementation: what transformers is asked for, and what the built model then runs."""

from __future__ import annotations

import pytest

from elastictrain.config import ConfigError, load_config
from elastictrain.model.build import attention_kernel, build_causal_lm


def test_auto_leaves_transformers_default_on_cpu_and_the_built_model_runs_sdpa():
    cfg = load_config(None)
    assert cfg.model.attn_implementation == "auto" and attention_kernel(cfg) is None
    model = build_causal_lm(dict(cfg.model.hf_config), attention=attention_kernel(cfg))
    assert model.config._attn_implementation == "sdpa"


def test_auto_picks_flash_attention_on_gpus_in_bf16_only_where_the_package_is_installed(monkeypatch):
    import importlib.util

    cfg = load_config(None, ["scaling.use_gpu=true", "training.precision=bf16", "deepspeed.zero_stage=1"])
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: object() if n == "flash_attn" else real(n, *a)
    )
    assert attention_kernel(cfg) == "flash_attention_2"
    cfg.training.precision = "fp32"
    assert attention_kernel(cfg) is None  # flash attention has no fp32 kernel
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "flash_attn" else real(n, *a))
    cfg.training.precision = "bf16"
    assert attention_kernel(cfg) is None


def test_an_explicit_kernel_reaches_the_built_model():
    cfg = load_config(None, ["model.attn_implementation=eager"])
    model = build_causal_lm(dict(cfg.model.hf_config), attention=attention_kernel(cfg))
    assert model.config._attn_implementation == "eager"


def test_an_unknown_kernel_is_refused_naming_the_valid_ones():
    with pytest.raises(
        ConfigError, match="model.attn_implementation: got 'flash'; expected one of auto, eager"
    ):
        load_config(None, ["model.attn_implementation=flash"])
