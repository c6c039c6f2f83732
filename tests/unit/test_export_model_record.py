"""Issue 36 point 1: what a checkpoint records about its model (checkpoint/model_record.py), read the
same way by export, eval and resume, older manifests (only `model.hf_config`) included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from integration.pretrained_models import make_pretrained

from elastictrain.checkpoint.model_record import built_model, configured_model, model_mismatch, model_record
from elastictrain.config import load_config


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    return make_pretrained(tmp_path_factory.mktemp("src") / "qwen", "qwen2")


def manifest_of(config, model: torch.nn.Module | None = None) -> dict:  # noqa: ANN001
    record = configured_model(config)
    if model is not None:
        record["built"] = built_model(model)
    return json.loads(json.dumps({"model": record}))  # as a manifest holds it


def test_the_driver_records_the_configured_source_paths_tokenizer_and_precision(qwen, tmp_path):
    cfg = load_config(None, [f"model.pretrained={qwen}", "training.precision=bf16"])
    record = configured_model(cfg)
    assert record["source"] == "pretrained" and record["pretrained"] == str(qwen.resolve())
    assert record["tokenizer"] == str(qwen.resolve()), "the pretrained folder holds a tokenizer"
    assert record["precision"] == "bf16"
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    with_tokenizer = load_config(None, [f"model.pretrained={qwen}", f"data.tokenizer={tokenizer}"])
    assert configured_model(with_tokenizer)["tokenizer"] == str(tokenizer.resolve())
    plain = configured_model(load_config(None))
    assert plain["source"] == "hf_config" and plain["tokenizer"] is None and plain["pretrained"] is None


def test_a_worker_records_the_built_transformers_model_and_peft_config_as_plain_json(qwen):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen)
    built = built_model(model, activation_checkpointing=True)
    assert built["architecture"] == "Qwen2ForCausalLM" and built["config"]["num_key_value_heads"] == 2
    assert "use_cache" not in built["config"], "training's use_cache=False must not reach the export"
    assert "_name_or_path" not in built["config"] and built["generation_config"]["top_p"] == 0.9
    wrapped = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    peft = built_model(wrapped)["peft"]
    assert peft["target_modules"] == ["q_proj", "v_proj"] and peft["peft_type"] == "LORA" and peft["r"] == 4
    assert json.loads(json.dumps(built_model(wrapped))) == built_model(wrapped)
    other = built_model(torch.nn.Linear(2, 2))
    assert other["config"] is None and other["architecture"] == "Linear"


def test_an_older_manifest_reads_as_a_model_built_from_its_hf_config():
    hf_config = dict(load_config(None).model.hf_config)
    record = model_record({"model": {"hf_config": hf_config}})
    assert record.source == "hf_config" and record.config == hf_config and not record.recorded
    assert record.precision == "fp32" and record.peft is None and record.tokenizer is None


def test_resume_and_eval_refuse_a_checkpoint_of_another_model_by_its_record(qwen, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = load_config(None, [f"model.pretrained={qwen}"])
    manifest = manifest_of(cfg, AutoModelForCausalLM.from_pretrained(qwen))
    assert model_mismatch(manifest, configured_model(cfg)) == []
    moved = tmp_path / "moved"
    make_pretrained(moved, "qwen2")
    assert model_mismatch(manifest, configured_model(load_config(None, [f"model.pretrained={moved}"]))) == []
    llama = make_pretrained(tmp_path / "llama", "llama")
    found = model_mismatch(manifest, configured_model(load_config(None, [f"model.pretrained={llama}"])))
    assert any(
        f"model.pretrained ({llama.resolve()}/config.json).model_type: checkpoint has 'qwen2'" in f
        for f in found
    )
    from_config = model_mismatch(manifest, configured_model(load_config(None)))
    assert from_config == [
        "model: the checkpoint's model was built from model.pretrained, "
        "the config's is built from model.hf_config"
    ]
    older = {"model": {"hf_config": dict(load_config(None).model.hf_config)}}
    bigger = load_config(None, ["model.hf_config.hidden_size=128"])
    assert model_mismatch(older, configured_model(bigger)) == [
        "model.hf_config.hidden_size: checkpoint has 64, config has 128"
    ]
