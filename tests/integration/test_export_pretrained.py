"""Issue 36: any run exports a model you can serve. A real run (2 Ray workers, ZeRO-3) of a pretrained
Qwen2 folder made here (pretrained_models.py), exported with the CLI and loaded with transformers.

Before the fix, the export of a `model.pretrained` run wrote conf/tiny-cpu.yaml's default config
(llama, hidden 64, vocab 256) beside the Qwen2 weights: the test of the config fails on that code. An
untied export (Llama and others) is test_architectures.py's; a LoRA run's export, which wrote its
adapter tensors as model.safetensors, is test_sft_lora_export.py's (it imports the helpers here).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import run, tiny_config
from pretrained_models import make_pretrained
from typer.testing import CliRunner

from elastictrain.checkpoint.zero_state import FragmentReader
from elastictrain.cli import app

pytestmark = pytest.mark.integration

STEPS = 3
# What training (and the export's dtype) may change in config.json; everything else stays the source's.
CHANGED_BY_EXPORT = {"dtype", "transformers_version"}
BF16_UNIT_ROUNDOFF = 2.0**-8


def train(tmp: Path, kind: str, *overrides: str) -> tuple[Path, Path]:
    """(pretrained folder, run folder) of STEPS steps of a fine-tune of a `kind` folder."""
    source = make_pretrained(tmp / kind, kind)
    cfg = tiny_config(
        tmp / "run",
        f"model.pretrained={source}",
        f"training.max_steps={STEPS}",
        f"checkpoint.every_steps={STEPS}",
        "training.warmup_steps=1",
        "data.generated_chars=20000",
        *overrides,
    )
    summary, run_dir, output = run(cfg, tracking=False)
    assert summary.status.value == "FINISHED", output
    return source, run_dir.path


@pytest.fixture(scope="module")
def qwen_run(ray_local, tmp_path_factory) -> tuple[Path, Path]:
    return train(tmp_path_factory.mktemp("qwen"), "qwen2")


def export(run_dir: Path, out: Path, *options: str) -> str:
    result = CliRunner().invoke(app, ["export", str(run_dir), "--out", str(out), *options])
    assert result.exit_code == 0, result.output
    return result.output


def checkpoint_reader(run_dir: Path) -> FragmentReader:
    return FragmentReader(sorted((run_dir / "checkpoints" / f"step-{STEPS:06d}").glob("rank-*.safetensors")))


def trained_model(source: Path, run_dir: Path) -> torch.nn.Module:
    """The trained model, built here: the source model with every parameter read from the checkpoint."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    reader = checkpoint_reader(run_dir)
    params = dict(model.named_parameters())
    assert set(params) == set(reader.params)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(reader.full(name))
    return model.eval()


def sample_ids() -> torch.Tensor:
    return torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(3))


@torch.no_grad()
def logits(model: torch.nn.Module) -> torch.Tensor:
    return model(input_ids=sample_ids()).logits.float()


def loaded(folder: Path, **kwargs: object) -> torch.nn.Module:
    """from_pretrained of an export: every weight of the files used, none missing, none resized."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True, **kwargs)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def config_of(folder: Path) -> dict:
    return {
        k: v
        for k, v in json.loads((folder / "config.json").read_text()).items()
        if k not in CHANGED_BY_EXPORT
    }


def test_a_fine_tuned_pretrained_model_exports_a_folder_that_loads_as_the_trained_model(qwen_run, tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    source, run_dir = qwen_run
    output = export(run_dir, tmp_path / "hf")
    out = tmp_path / "hf"
    assert "check: logits of 3 sequences" in output and "(model, float32)" in output

    assert config_of(out) == config_of(source), "the source's config, not conf/tiny-cpu.yaml's"
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    model = loaded(out)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight, "tied as the source"
    diff = (logits(model) - logits(trained_model(source, run_dir))).abs().max().item()
    assert diff <= 1e-5, f"export vs trained model logits differ by {diff:.2e}"
    moved = (logits(model) - logits(loaded(source))).abs().max().item()
    assert moved > 1e-3, "the export must hold the trained weights, not the source's"

    assert (
        GenerationConfig.from_pretrained(out).to_dict() == GenerationConfig.from_pretrained(source).to_dict()
    )
    tokenizer, original = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(source)
    assert tokenizer.chat_template == original.chat_template and tokenizer.chat_template
    chat = [{"role": "user", "content": "hello"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == original.apply_chat_template(
        chat, tokenize=False
    )
    print(f"EXPORT qwen2: max |export - trained| logit {diff:.1e}; training moved logits by {moved:.2f}")


def test_a_bf16_export_in_shards_loads_from_its_index_within_bf16s_tolerance(qwen_run, tmp_path):
    source, run_dir = qwen_run
    out = tmp_path / "bf16"
    output = export(run_dir, out, "--dtype", "bfloat16", "--max-shard-size", "20kB")
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors", shards
    assert not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    assert set(index["weight_map"]) == set(checkpoint_reader(run_dir).params)
    assert output.count("  shard ") == len(shards), "a progress line per shard"

    model = loaded(out)  # transformers' default dtype: the config's
    assert next(model.parameters()).dtype == torch.bfloat16
    want = logits(trained_model(source, run_dir))
    diff = (logits(model.float()) - want).abs().max().item()
    tolerance = BF16_UNIT_ROUNDOFF * want.abs().max().item()  # the logits as accurate as one bf16 number
    assert 0 < diff <= tolerance, f"bf16 export vs trained model: {diff:.2e} (tolerance {tolerance:.2e})"
    print(f"EXPORT bf16: {len(shards)} shards; max |export - trained| logit {diff:.1e} (tol {tolerance:.1e})")
    print("EXPORT bf16 " + next(line for line in output.splitlines() if line.startswith("check:")))


def test_the_checkpoint_records_the_model_as_built_and_reshard_keeps_the_record(qwen_run, tmp_path):
    source, run_dir = qwen_run
    checkpoint = run_dir / "checkpoints" / f"step-{STEPS:06d}"
    model = json.loads((checkpoint / "manifest.json").read_text())["model"]
    assert model["source"] == "pretrained" and model["pretrained"] == str(source.resolve())
    assert model["tokenizer"] == str(source.resolve())
    built = model["built"]
    assert built["architecture"] == "Qwen2ForCausalLM" and built["peft"] is None
    assert built["config"]["num_key_value_heads"] == 2 and built["config"]["vocab_size"] == 320
    assert built["generation_config"]["temperature"] == 0.7

    resharded = tmp_path / "ws3"
    result = CliRunner().invoke(
        app, ["reshard", str(checkpoint), "--world-size", "3", "--out", str(resharded)]
    )
    assert result.exit_code == 0, result.output
    assert json.loads((resharded / "manifest.json").read_text())["model"] == model
    export(resharded, tmp_path / "hf")
    assert config_of(tmp_path / "hf") == config_of(source)
