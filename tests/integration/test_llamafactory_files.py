"""LLaMA-Factory's own example YAMLs, unchanged but for their sizes, in a LLaMA-Factory working folder whose
model id resolves from a Hugging Face cache the test builds: each trains at 2 Ray workers (real DeepSpeed),
the LoRA run leaves its adapter at output_dir's top, the merge YAML exports a model equal to base +
adapter, and the file and its --print-config output train the same config to the same losses."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import KEEP_WARM, run
from llamafactory_workdir import make_workdir, shrink
from pretrained_models import make_pretrained
from test_plain_pytorch_equivalence import logged_losses

from elastictrain.config import load_config, to_printed_yaml

pytestmark = pytest.mark.integration

LORA = "examples/train_lora/qwen3_lora_sft.yaml"
FULL = "examples/train_full/qwen3_full_sft.yaml"
PRETRAIN = "examples/train_lora/qwen3_lora_pretrain.yaml"
MERGE = "examples/merge_lora/qwen3_lora_sft.yaml"
DPO = "examples/train_lora/qwen3_lora_dpo.yaml"
KTO = "examples/train_lora/qwen3_lora_kto.yaml"
# elastictrain's own keys beside the file's: two workers, bounded waits, warm workers for the next run.
AT_TWO = (
    "ray_num_workers=2",
    "failure.hang_timeout_s=60",
    "failure.wait_for_capacity_s=20",
    "tracking.system_metrics=false",
    KEEP_WARM,
)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    root = tmp_path_factory.mktemp("llamafactory")
    base = make_pretrained(root / "model", "qwen2")
    folder, hub = make_workdir(root, base)
    for name in (LORA, FULL, PRETRAIN, DPO, KTO):
        shrink(folder / name, plot_loss=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_CACHE", str(hub))
        mp.chdir(folder)  # LLaMA-Factory resolves output_dir, dataset_dir and deepspeed against it
        yield folder


def started(cfg):  # noqa: ANN001, ANN201
    """As `elastictrain train` starts it: num_epochs and warmup_ratio become step counts."""
    from elastictrain.driver.launch import resolve_length

    list(resolve_length(cfg))
    return cfg


def train(path: Path, *overrides: str):  # noqa: ANN201
    cfg = started(load_config(path, [*AT_TWO, *overrides]))
    summary, run_dir, output = run(cfg)
    assert summary.status.value == "FINISHED", output
    assert [e["world_size"] for e in run_dir.read_info().world_size_history] == [2]
    return cfg, run_dir


@pytest.fixture(scope="module")
def lora_run(ray_local, work):  # noqa: ANN001, ANN201
    return train(work / LORA)


def test_the_lora_example_trains_and_leaves_its_adapter_at_output_dirs_top(lora_run, work):
    cfg, run_dir = lora_run
    assert run_dir.path == work / "saves/qwen3-4b/lora/sft"
    assert cfg.training.global_batch_size == 8 and cfg.training.precision == "bf16"  # 2 x 2 x 2 workers
    for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer_config.json"):
        assert (run_dir.path / name).is_file(), name
    losses = logged_losses(run_dir)
    assert len(losses) == cfg.training.max_steps == 6  # 48 records, one epoch, 8 a step
    assert all(torch.isfinite(torch.tensor(losses)))


def test_its_printed_config_trains_the_same_losses(lora_run, work, tmp_path):
    cfg, run_dir = lora_run
    printed = tmp_path / "printed.yaml"
    printed.write_text(to_printed_yaml(load_config(work / LORA, list(AT_TWO))))
    again = load_config(printed)
    assert again == load_config(work / LORA, list(AT_TWO))
    moved = tmp_path / "again"
    summary, other, output = run(started(load_config(printed, [f"run.dir={moved}", "run.name=again"])))
    assert summary.status.value == "FINISHED", output
    assert logged_losses(other) == logged_losses(run_dir)


def test_the_full_example_trains_under_its_zero3_file(ray_local, work):
    cfg, run_dir = train(work / FULL)
    assert cfg.deepspeed.zero_stage == 3 and not cfg.model.lora.enabled
    assert cfg.deepspeed.config_file == str(work / "examples/deepspeed/ds_z3_config.json")
    assert logged_losses(run_dir)


def test_the_pretrain_example_trains_packed_text(ray_local, work):
    cfg, run_dir = train(work / PRETRAIN)
    assert cfg.data.source == "hf" and cfg.data.packing and cfg.data.seq_len == 128
    assert logged_losses(run_dir)


def test_the_merge_example_exports_base_plus_adapter(lora_run, work):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from typer.testing import CliRunner

    from elastictrain.cli.app import app

    cfg, run_dir = lora_run
    shrink(work / MERGE, export_size=1)
    result = CliRunner().invoke(app, ["export", "-c", str(work / MERGE)])
    assert result.exit_code == 0, result.output
    merged_dir = work / "saves/qwen3_sft_merged"
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(cfg.model.pretrained, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, run_dir.path).eval()
    ids = torch.randint(0, int(merged.config.vocab_size), (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (merged(input_ids=ids).logits - with_adapter(input_ids=ids).logits).abs().max().item()
    assert diff < 2e-2, diff  # bf16 weights (the run's precision) against float32 base + adapter
    assert AutoTokenizer.from_pretrained(merged_dir)("12 + 34")["input_ids"]

    # The same merge file naming a plain peft adapter folder (what LLaMA-Factory's own run leaves).
    adapter = work / "adapter-only"
    adapter.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy2(run_dir.path / name, adapter / name)
    shrink(work / MERGE, adapter_name_or_path="adapter-only", export_dir="saves/from_peft")
    result = CliRunner().invoke(app, ["export", "-c", str(work / MERGE)])
    assert result.exit_code == 0, result.output
    from_peft = AutoModelForCausalLM.from_pretrained(work / "saves/from_peft", dtype=torch.float32).eval()
    with torch.no_grad():
        diff = (from_peft(input_ids=ids).logits - with_adapter(input_ids=ids).logits).abs().max().item()
    assert diff < 1e-4, diff  # float32 base (the base folder's dtype) + adapter, merged


@pytest.mark.parametrize(("name", "objective"), [(DPO, "dpo"), (KTO, "kto")], ids=["dpo", "kto"])
def test_the_preference_examples_train_their_objective_with_the_adapters_off_as_reference(
    work, name, objective
):
    cfg, run_dir = train(work / name)
    assert cfg.training.objective == objective and cfg.model.lora.enabled
    assert (run_dir.path / "adapter_model.safetensors").is_file()
    losses = logged_losses(run_dir)
    assert len(losses) == cfg.training.max_steps and all(torch.isfinite(torch.tensor(losses)))
    # Before the first update the policy is its reference: DPO's loss is ln 2, KTO's 0.5 (its KL is 0).
    assert losses[0] == pytest.approx(0.6931472 if objective == "dpo" else 0.5, abs=1e-6)
