"""Issue 36: `elastictrain export` on checkpoints made here from real transformers and peft models
(export_checkpoints.py, no Ray or DeepSpeed): options, what each kind of run exports, the check, and
that a failed export leaves nothing that looks like a finished one."""

from __future__ import annotations

import json
import struct
import weakref
from pathlib import Path

import pytest
import torch
from export_checkpoints import checkpoint_of, trained
from integration.pretrained_models import make_pretrained
from typer.testing import CliRunner

from elastictrain.cli import app
from elastictrain.tools import export as export_module
from elastictrain.tools.export_shards import Tensors, dtype_named, parse_size, write_shards

cli = CliRunner()


def invoke(args: list[str], code: int = 0) -> str:
    result = cli.invoke(app, args)
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    # stdout only: a library logger (transformers') that first logged inside an earlier CliRunner call keeps
    # that call's closed stream, and logging then prints its own "Logging error" traceback to stderr.
    assert "Traceback" not in result.stdout
    return " ".join(result.output.split())


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    return make_pretrained(tmp_path_factory.mktemp("src") / "qwen", "qwen2")


@pytest.fixture(scope="module")
def qwen_checkpoint(qwen, tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM

    model = trained(AutoModelForCausalLM.from_pretrained(qwen))
    return checkpoint_of(model, tmp_path_factory.mktemp("ckpt"), pretrained=qwen)


def safetensors_dtypes(path: Path) -> set[str]:
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


def test_sizes_and_dtypes_are_read_as_transformers_reads_them_and_errors_name_the_option():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 500 * 10**6
    assert parse_size("1.5GB") == 1_500_000_000 and parse_size("123456") == parse_size(123456) == 123456
    for bad in ("5 parsecs", "0", "-1MB", ""):
        with pytest.raises(
            ValueError, match=r"--max-shard-size: got .*; expected a positive size such as 5GB"
        ):
            parse_size(bad)
    assert dtype_named("bf16") is dtype_named("bfloat16") is torch.bfloat16
    assert dtype_named("fp32") is torch.float32 and dtype_named("float16") is torch.float16
    with pytest.raises(ValueError, match=r"--dtype: got 'int8'; expected one of float32, bfloat16, float16"):
        dtype_named("int8")


def test_the_export_dtype_defaults_to_the_training_precision(qwen, tmp_path):
    from transformers import AutoModelForCausalLM

    checkpoint = checkpoint_of(
        AutoModelForCausalLM.from_pretrained(qwen), tmp_path / "ck", pretrained=qwen, precision="bf16"
    )
    output = invoke(["export", str(checkpoint), "--out", str(tmp_path / "bf16")])
    assert "(model, bfloat16)" in output
    assert safetensors_dtypes(tmp_path / "bf16" / "model.safetensors") == {"BF16"}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    invoke(["export", str(checkpoint), "--out", str(tmp_path / "fp32"), "--dtype", "float32"])
    assert safetensors_dtypes(tmp_path / "fp32" / "model.safetensors") == {"F32"}


def test_shards_are_written_from_one_tensor_at_a_time(tmp_path):
    made: list[weakref.ref] = []
    most_alive = 0

    def make(name: str) -> torch.Tensor:
        nonlocal most_alive  # tensors hold no cycles: freed as soon as nothing refers to them
        most_alive = max(most_alive, sum(r() is not None for r in made))
        tensor = torch.full((1000,), float(len(made)))
        made.append(weakref.ref(tensor))
        return tensor

    shapes = {f"t{i}": (1000,) for i in range(12)}
    written = write_shards(Tensors(shapes, make), tmp_path, torch.float32, 10_000)
    assert [p.name for p in written][-1] == "model.safetensors.index.json" and len(written) == 7
    # The tensor being written and the one made before it: never a shard's worth, never the model's.
    assert most_alive <= 1, most_alive


@pytest.fixture
def earlier_export(qwen_checkpoint, tmp_path) -> Path:
    out = tmp_path / "hf"
    invoke(["export", str(qwen_checkpoint), "--out", str(out)])
    return out


def test_a_failed_logit_check_publishes_nothing_and_keeps_an_earlier_export(
    qwen_checkpoint, earlier_export, tmp_path, monkeypatch
):
    before = {p.name: p.read_bytes() for p in earlier_export.iterdir()}
    real_write = export_module.write_shards

    def one_wrong_tensor(tensors, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        def get(name: str) -> torch.Tensor:
            t = tensors.get(name)
            return t + 0.5 if name == "model.layers.1.mlp.down_proj.weight" else t

        return real_write(Tensors(tensors.shapes, get), *args, **kwargs)

    monkeypatch.setattr(export_module, "write_shards", one_wrong_tensor)
    fresh = tmp_path / "fresh"
    for out in (fresh, earlier_export):
        output = invoke(["export", str(qwen_checkpoint), "--out", str(out)], code=1)
        assert (
            "export check failed: the exported model's logits differ from the checkpoint's by up to" in output
        )
        assert f"Nothing was written to {out}" in output
    assert not fresh.exists()
    assert {p.name: p.read_bytes() for p in earlier_export.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"], "no partial folder left beside"


def test_out_must_be_new_empty_or_an_earlier_export(qwen_checkpoint, earlier_export, tmp_path):
    invoke(["export", str(qwen_checkpoint), "--out", str(earlier_export)])  # replaced
    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "notes.txt").write_text("mine")
    output = invoke(["export", str(qwen_checkpoint), "--out", str(keep)], code=2)
    assert f"--out: {keep} is a non-empty folder that is not an earlier export" in output
    assert [p.name for p in keep.iterdir()] == ["notes.txt"]


def test_a_model_that_is_not_a_transformers_model_exports_its_state_dict_and_no_config(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    checkpoint = checkpoint_of(model, tmp_path / "ck", source="factory")
    output = invoke(["export", str(checkpoint), "--out", str(tmp_path / "sd")])
    assert "not a transformers model (Sequential, from model.factory): wrote its state dict only" in output
    assert not (tmp_path / "sd" / "config.json").exists()
    from safetensors.torch import load_file

    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    fresh.load_state_dict(load_file(tmp_path / "sd" / "model.safetensors"))
    x = torch.randn(3, 4)
    assert torch.equal(fresh(x), model(x))


def test_a_checkpoint_with_an_older_manifest_still_exports_the_model_of_its_hf_config(tmp_path):
    from transformers import AutoModelForCausalLM

    from elastictrain.config import load_config
    from elastictrain.model.build import build_causal_lm

    hf_config = dict(load_config(None).model.hf_config)
    torch.manual_seed(0)
    checkpoint = checkpoint_of(build_causal_lm(hf_config), tmp_path / "ck", record=False)
    assert set(json.loads((checkpoint / "manifest.json").read_text())["model"]) == {"hf_config"}
    invoke(["export", str(checkpoint), "--out", str(tmp_path / "hf")])
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.hidden_size == hf_config["hidden_size"] and model.config.model_type == "llama"


def test_lora_adapters_under_an_older_manifest_are_refused_not_written_as_a_model(qwen, tmp_path):
    """The old export wrote these LoRA tensors as model.safetensors with the default config."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    wrapped = get_peft_model(
        AutoModelForCausalLM.from_pretrained(qwen), LoraConfig(target_modules=["q_proj"])
    )
    checkpoint = checkpoint_of(wrapped, tmp_path / "ck", record=False)
    output = invoke(["export", str(checkpoint), "--out", str(tmp_path / "hf")], code=2)
    assert "the checkpoint's parameters are not those of" in output and "lora_A" in output
    assert not (tmp_path / "hf").exists()


def test_merge_lora_is_refused_for_a_run_without_lora(qwen_checkpoint, tmp_path):
    output = invoke(["export", str(qwen_checkpoint), "--out", str(tmp_path / "m"), "--merge-lora"], code=2)
    assert "--merge-lora:" in output and "is not of a LoRA run (model.lora.enabled was false)" in output


def test_a_bf16_adapter_loads_with_peft_onto_its_base(qwen, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    wrapped = trained(
        get_peft_model(AutoModelForCausalLM.from_pretrained(qwen), LoraConfig(target_modules=["v_proj"]))
    )
    checkpoint = checkpoint_of(wrapped, tmp_path / "ck", pretrained=qwen, precision="bf16")
    output = invoke(["export", str(checkpoint), "--out", str(tmp_path / "adapter")])
    assert "(adapter, bfloat16)" in output and "check: logits of 3 sequences" in output
    assert safetensors_dtypes(tmp_path / "adapter" / "adapter_model.safetensors") == {"BF16"}
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(qwen), tmp_path / "adapter")
    ids = torch.tensor([[1, 5, 9, 200, 17]])
    with torch.no_grad():
        want = wrapped.eval()(input_ids=ids).logits
        diff = (loaded.eval()(input_ids=ids).logits - want).abs().max().item()
    assert diff <= 2.0**-8 * max(1.0, want.abs().max().item()), diff  # bf16's unit roundoff


def test_a_lora_run_on_a_base_built_from_a_config_exports_its_adapter_but_cannot_merge_it(tmp_path):
    from peft import LoraConfig, get_peft_model

    from elastictrain.config import load_config
    from elastictrain.model.build import build_causal_lm

    base = build_causal_lm(dict(load_config(None).model.hf_config))
    wrapped = get_peft_model(base, LoraConfig(target_modules=["q_proj"]))
    checkpoint = checkpoint_of(wrapped, tmp_path / "ck", source="hf_config")
    output = invoke(["export", str(checkpoint), "--out", str(tmp_path / "adapter")])
    assert (
        "(adapter, float32)" in output
        and "not checked: the base model was built from model.hf_config" in output
    )
    assert (
        json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
        is None
    )
    refused = invoke(["export", str(checkpoint), "--out", str(tmp_path / "merged"), "--merge-lora"], code=2)
    assert "the run's base model was built from model.hf_config, not loaded from a folder" in refused
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize(
    "lora",
    [
        {"target_modules": "all-linear", "use_dora": True, "use_rslora": True},
        {"target_modules": ["q_proj", "v_proj"], "modules_to_save": ["lm_head"]},
    ],
    ids=["dora-rslora-all-linear", "modules-to-save"],
)
def test_lora_variants_export_as_an_adapter_and_merged_and_pass_the_check(qwen, tmp_path, lora):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    wrapped = trained(get_peft_model(AutoModelForCausalLM.from_pretrained(qwen), LoraConfig(r=4, **lora)))
    checkpoint = checkpoint_of(wrapped, tmp_path / "ck", pretrained=qwen)
    assert "(adapter, float32)" in invoke(["export", str(checkpoint), "--out", str(tmp_path / "adapter")])
    merged = invoke(["export", str(checkpoint), "--out", str(tmp_path / "merged"), "--merge-lora"])
    assert "(merged, float32)" in merged and "check: logits of 3 sequences" in merged
