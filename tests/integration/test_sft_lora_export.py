"""Issue 37's last test and issue 36's LoRA exports, on one LoRA fine-tune of a pretrained folder on chat
records (2 Ray workers, ZeRO-3). Exported as it is by default, the adapter loads with peft and acts as the
one the run wrote at its end; exported with --merge-lora, the base with the adapter merged in loads with
transformers, gives the PeftModel's logits, and its loss on answers it never trained on is below the
base model's. Before issue 36's fix a LoRA run's export wrote its adapter tensors as model.safetensors.

Issue 57: the pretrained folder is one whose tokenizer_config.json names TokenizersBackend (what
PreTrainedTokenizerFast.save_pretrained writes) beside a qwen2 config.json, with a tokenizer whose merges
join digits: the run tokenizes with Qwen2Tokenizer, and the same files without config.json load as
TokenizersBackend, which tokenizes numbers otherwise; before the fix `export` refused the run for it. And
model.lora.export_dir is the run folder, as LLaMA-Factory's YAMLs set it: the adapter and the tokenizer
are at the run folder's top, and `elastictrain export RUN_DIR` still exports the run's checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import run, tiny_config
from sft_fixtures import write_records
from test_export_pretrained import config_of, export, loaded, logits
from unit.test_tokenizer_class_export import CHECKED, qwen2_folder_with_digit_merges

pytestmark = pytest.mark.integration


def sft(base: Path) -> tuple[str, ...]:
    return ("data.source=sft", "data.packing=false", "data.seq_len=128", f"model.pretrained={base}")


@pytest.fixture(scope="module")
def lora_run(ray_local, tmp_path_factory) -> tuple[Path, Path]:
    """(base folder, run folder) of a LoRA fine-tune of a Qwen2 folder on 96 ShareGPT records, its adapter
    written at the run folder's top."""
    tmp = tmp_path_factory.mktemp("lora")
    base = qwen2_folder_with_digit_merges(tmp / "base")
    cfg = tiny_config(
        tmp / "run",
        *sft(base),
        f"data.path={write_records(tmp / 'train', 'sharegpt', 96, seed=1)}",
        "model.lora.enabled=true",
        "model.lora.export_dir=${run.dir}",
        "model.lora.target_modules=all-linear",
        "model.lora.r=8",
        "training.max_steps=24",  # two epochs of 96 records at 8 a step
        "training.global_batch_size=8",
        "training.micro_batch_size=2",
        "training.lr=0.01",
        "checkpoint.every_steps=24",
        "scaling.min_workers=2",
        "scaling.max_workers=2",
    )
    summary, run_dir, output = run(cfg, tracking=False)
    assert summary.status.value == "FINISHED", output
    return base, run_dir.path


@pytest.fixture(scope="module")
def merged(lora_run, tmp_path_factory) -> tuple[Path, str]:
    """(folder, the CLI's output) of the run exported with --merge-lora."""
    out = tmp_path_factory.mktemp("merged") / "hf"
    return out, export(lora_run[1], out, "--merge-lora")


def answer_loss(model: torch.nn.Module, dataset) -> float:  # noqa: ANN001 - an sft dataset
    """The mean loss per trained (answer) token over every record of `dataset`."""
    total, tokens = 0.0, 0
    with torch.no_grad():
        for i in range(len(dataset)):
            item = dataset[i]
            ids, labels = item["input_ids"][None], item["labels"][None]
            n = int((labels[:, 1:] != -100).sum())  # the tokens predicted: labels are shifted by the model
            total += float(model(input_ids=ids, labels=labels).loss) * n
            tokens += n
    return total / tokens


def test_a_lora_run_exports_its_adapter_for_peft_by_default(lora_run, tmp_path):
    from peft import PeftModel

    source, run_dir = lora_run
    output = export(run_dir, tmp_path / "adapter")
    out = tmp_path / "adapter"
    assert "(adapter, float32)" in output
    assert not (out / "model.safetensors").exists() and not (out / "config.json").exists()
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(source.resolve())
    # The check passed: the tokenizer beside the adapter loads, from it alone, as the run tokenized.
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "Qwen2Tokenizer"

    exported = PeftModel.from_pretrained(loaded(source), out).eval()
    at_run_end = PeftModel.from_pretrained(loaded(source), run_dir).eval()  # tools/adapter.py's, at the top
    diff = (logits(exported) - logits(at_run_end)).abs().max().item()
    assert diff <= 1e-6, diff
    assert (logits(exported) - logits(loaded(source))).abs().max().item() > 1e-3, "the adapter must act"


def test_a_lora_run_writes_its_adapter_and_the_tokenizer_it_trained_with_at_its_run_folders_top(lora_run):
    from transformers import AutoTokenizer

    source, run_dir = lora_run
    for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (run_dir / name).is_file(), name
    assert (run_dir / "run.json").is_file() and (run_dir / "config.yaml").is_file()
    assert not (run_dir / "adapter").exists() and not list(run_dir.glob(".*partial*"))
    trained_with, at_top = AutoTokenizer.from_pretrained(source), AutoTokenizer.from_pretrained(run_dir)
    assert type(trained_with).__name__ == type(at_top).__name__ == "Qwen2Tokenizer"
    assert at_top(CHECKED)["input_ids"] == trained_with(CHECKED)["input_ids"]
    assert json.loads((run_dir / "tokenizer_config.json").read_text())["tokenizer_class"] == "Qwen2Tokenizer"


def test_a_lora_run_exports_the_base_with_the_adapter_merged_in_with_merge_lora(lora_run, merged):
    from peft import PeftModel

    source, run_dir = lora_run
    out, output = merged
    assert "(merged, float32)" in output and not (out / "adapter_config.json").exists()
    assert config_of(out) == config_of(source)
    model = loaded(out)
    assert not any("lora" in name for name, _ in model.named_parameters())
    peft_model = PeftModel.from_pretrained(loaded(source), run_dir).eval()
    diff = (logits(model) - logits(peft_model)).abs().max().item()
    assert diff <= 1e-4, f"merged export vs PeftModel: {diff:.2e}"
    print(f"EXPORT merged LoRA: max |merged - PeftModel| logit {diff:.1e}")


def test_a_lora_fine_tune_on_chat_records_exports_a_model_that_answers_held_out_records_better(
    lora_run, merged, tmp_path: Path
) -> None:
    from elastictrain.data.sources import dataset_from_config

    base, _ = lora_run
    held_out_file = write_records(tmp_path / "held-out", "sharegpt", 24, seed=2)
    held_out = dataset_from_config(tiny_config(tmp_path / "unused", *sft(base), f"data.path={held_out_file}"))
    before = answer_loss(loaded(base), held_out)
    after = answer_loss(loaded(merged[0]), held_out)
    assert after < before - 0.1, f"held-out answer loss: base {before:.3f}, fine-tuned {after:.3f}"
