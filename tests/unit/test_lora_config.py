"""The `model.lora` options (issue 36): how each is checked when the config loads, what peft is given,
and what it makes trainable on a real tiny transformers model (built here, nothing downloaded).

Training with them, under ZeRO-3 and across a resume at another world size: tests/integration/
test_lora_options.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from elastictrain.config import ConfigError, load_config
from elastictrain.driver.preflight import check_user_code
from elastictrain.model.build import build_causal_lm
from elastictrain.model.lora import apply_lora, peft_config
from elastictrain.user_code import UserCodeError

LORA = "model.lora.enabled=true"


def config(tmp_path: Path, *overrides: str):  # noqa: ANN201
    return load_config(None, [f"run.dir={tmp_path / 'run'}", LORA, *overrides])


def problems(tmp_path: Path, *overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        config(tmp_path, *overrides)
    return str(e.value)


def tiny_model(tmp_path: Path, *overrides: str) -> tuple[torch.nn.Module, object]:
    cfg = config(tmp_path, *overrides)
    torch.manual_seed(0)
    return build_causal_lm(dict(cfg.model.hf_config)), cfg


# -- loading ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["all-linear", "all", "ALL-LINEAR", "[q_proj,k_proj]"])
def test_target_modules_take_a_list_or_all_linear_in_peft_or_llama_factory_spelling(tmp_path, value):
    cfg = config(tmp_path, f"model.lora.target_modules={value}")
    assert cfg.model.lora.target_modules == (["q_proj", "k_proj"] if value.startswith("[") else value)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["model.lora.target_modules=q_proj"], "model.lora.target_modules: got 'q_proj'; expected a list"),
        (["model.lora.target_modules=[]"], "model.lora.target_modules: got []; expected a list of layer"),
        (["model.lora.target_modules=3"], "model.lora.target_modules: got 3; expected a list"),
        (["model.lora.target_modules=every"], "or all-linear (every linear layer but the output head"),
        (["model.lora.use_dora=maybe"], "model.lora.use_dora: got 'maybe'; expected true or false"),
        (["model.lora.modules_to_save=lm_head"], "modules_to_save: got 'lm_head'; expected a list"),
        (["model.lora.modules_to_save=['']"], "model.lora.modules_to_save: got ['']; expected module names"),
        (
            ["model.lora.target_modules=[q_proj,lm_head]", "model.lora.modules_to_save=[lm_head]"],
            "model.lora.modules_to_save: ['lm_head'] are also in model.lora.target_modules",
        ),
        (["model.lora.alpha=0"], "model.lora.alpha: got 0.0; expected a number > 0"),
    ],
)
def test_bad_lora_options_are_refused_naming_the_field_the_value_and_what_fits(tmp_path, overrides, expected):
    assert expected in problems(tmp_path, *overrides)


def test_a_disabled_section_has_its_types_checked_but_not_its_values(tmp_path):
    load_config(None, [f"run.dir={tmp_path}", "model.lora.r=0", "model.lora.modules_to_save=['']"])
    with pytest.raises(ConfigError, match="model.lora.target_modules: got 'q_proj'; expected a list"):
        load_config(None, [f"run.dir={tmp_path}", "model.lora.target_modules=q_proj"])


# -- what peft is given ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "peft_value"), [("all", "all-linear"), ("All-Linear", "all-linear")])
def test_llama_factory_all_is_peft_all_linear(tmp_path, value, peft_value):
    model, cfg = tiny_model(tmp_path, f"model.lora.target_modules={value}")
    assert peft_config(cfg.model.lora, model).target_modules == peft_value


def test_each_option_reaches_peft_lora_config(tmp_path):
    model, cfg = tiny_model(
        tmp_path,
        "model.lora.r=4",
        "model.lora.alpha=8",
        "model.lora.dropout=0.1",
        "model.lora.use_dora=true",
        "model.lora.use_rslora=true",
        "model.lora.modules_to_save=[lm_head,embed_tokens]",
    )
    got = peft_config(cfg.model.lora, model)
    assert (got.r, got.lora_alpha, got.lora_dropout) == (4, 8.0, 0.1)
    assert got.use_dora and got.use_rslora
    assert got.modules_to_save == ["lm_head", "embed_tokens"]
    assert set(got.target_modules) == {"q_proj", "v_proj"} and got.task_type == "CAUSAL_LM"
    plain = peft_config(config(tmp_path).model.lora, model)
    assert not plain.use_dora and not plain.use_rslora and plain.modules_to_save is None


# -- what trains -------------------------------------------------------------------------------------------
def trainable(model: torch.nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def test_all_linear_adapts_every_linear_layer_but_the_output_head(tmp_path):
    model, cfg = tiny_model(tmp_path, "model.lora.target_modules=all")
    wrapped = apply_lora(model, cfg.model.lora)
    adapted = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n in trainable(wrapped) if ".lora_A." in n}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert not any("lm_head" in n for n in trainable(wrapped))
    layers = cfg.model.hf_config["num_hidden_layers"]
    assert len(trainable(wrapped)) == 2 * 7 * layers  # A and B of 7 layers per block


def test_dora_adds_one_trained_magnitude_per_adapted_layer_equal_to_the_row_norms_at_first(tmp_path):
    model, cfg = tiny_model(tmp_path, "model.lora.use_dora=true")
    q_weight = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    wrapped = apply_lora(model, cfg.model.lora)
    magnitudes = sorted(n for n in trainable(wrapped) if "lora_magnitude_vector" in n)
    assert len(magnitudes) == 2 * cfg.model.hf_config["num_hidden_layers"]  # q_proj and v_proj
    first = dict(wrapped.named_parameters())[magnitudes[0].replace("v_proj", "q_proj")]
    torch.testing.assert_close(first.detach(), q_weight.norm(dim=1))  # B = 0: the base rows' norms


def test_rslora_scales_by_alpha_over_the_square_root_of_r(tmp_path):
    for rs, scale in (("false", 16 / 8), ("true", 16 / math.sqrt(8))):
        model, cfg = tiny_model(tmp_path, f"model.lora.use_rslora={rs}")
        layer = apply_lora(model, cfg.model.lora).base_model.model.model.layers[0].self_attn.q_proj
        assert layer.scaling["default"] == pytest.approx(scale)


def test_modules_to_save_train_a_full_copy_and_leave_the_original_frozen(tmp_path):
    model, cfg = tiny_model(tmp_path, "model.lora.modules_to_save=[lm_head,embed_tokens]")
    head = model.lm_head.weight.detach().clone()
    wrapped = apply_lora(model, cfg.model.lora)
    copies = {n for n in trainable(wrapped) if "modules_to_save" in n}
    assert copies == {
        "base_model.model.lm_head.modules_to_save.default.weight",
        "base_model.model.model.embed_tokens.modules_to_save.default.weight",
    }
    params = dict(wrapped.named_parameters())
    assert torch.equal(params["base_model.model.lm_head.modules_to_save.default.weight"].detach(), head)
    assert not params["base_model.model.lm_head.original_module.weight"].requires_grad


# -- names checked against the model on the driver ----------------------------------------------------------
def driver_error(cfg) -> str:  # noqa: ANN001
    with pytest.raises(UserCodeError) as e:
        check_user_code(cfg)
    return str(e.value)


def test_a_list_of_targets_that_match_nothing_is_still_refused_by_name(tmp_path):
    message = driver_error(config(tmp_path, "model.lora.target_modules=[qkv,q_proj]"))
    assert message.startswith("model.lora.target_modules: ['qkv'] match no module of the model")
    assert "q_proj" in message


def test_modules_to_save_that_match_nothing_are_refused_with_the_names_the_model_has(tmp_path):
    message = driver_error(config(tmp_path, "model.lora.modules_to_save=[output_head]"))
    assert message.startswith("model.lora.modules_to_save: ['output_head'] match no module of the model")
    assert "lm_head" in message and "embed_tokens" in message


def test_all_linear_on_a_model_without_linear_layers_says_so(tmp_path):
    from elastictrain.model.lora import _check_targets

    cfg = config(tmp_path, "model.lora.target_modules=all-linear")
    with pytest.raises(ValueError, match="all-linear matches no linear layer of the model"):
        _check_targets(torch.nn.Sequential(torch.nn.Embedding(4, 2), torch.nn.ReLU()), cfg.model.lora)
    check_user_code(cfg)  # the built-in Llama has linear layers
