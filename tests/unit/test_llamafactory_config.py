"""LLaMA-Factory training YAMLs read with LLaMA-Factory's meaning: each mapped key, each default, each
refusal, the examples as its repository ships them, hub ids from a cache the test builds, templates."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from integration.pretrained_models import make_pretrained
from llamafactory_workdir import COMMIT, MODEL_ID, cache_model, make_workdir, write_data

from elastictrain.config import ConfigError, load_config, to_printed_yaml, to_yaml
from elastictrain.config.llamafactory import keys as lf_keys
from elastictrain.config.llamafactory import translate
from elastictrain.config.llamafactory.keys import KEYS, MAPPED, NO_EFFECT, REFUSED


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pretrained(tmp_path_factory.mktemp("model") / "qwen", "qwen2")


@pytest.fixture
def work(tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder, hub = make_workdir(tmp_path, model)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU: the starting world size is 1 unless given
    monkeypatch.chdir(folder)
    return folder


def minimal(**keys: Any) -> dict[str, Any]:
    return {"stage": "sft", "do_train": True, "model_name_or_path": MODEL_ID, "dataset": "identity", **keys}


def native(work: Path, **keys: Any) -> dict[str, Any]:
    t = translate(minimal(**keys), cwd=work, gpus=0)
    assert not t.problems, t.problems
    flat: dict[str, Any] = {}

    def walk(node: dict[str, Any], prefix: str = "") -> None:
        for k, v in node.items():
            if isinstance(v, dict) and k not in ("hf_config",):
                walk(v, f"{prefix}{k}.")
            else:
                flat[prefix + k] = v

    walk(t.native)
    return flat


# (LLaMA-Factory key, value given, elastictrain key, what it becomes): one row a mapped key.
MAPPED_CASES = [
    ("finetuning_type", "full", "model.lora.enabled", False),
    ("finetuning_type", "lora", "model.lora.enabled", True),
    ("lora_rank", 16, "model.lora.r", 16),
    ("lora_alpha", 7, "model.lora.alpha", 7.0),
    ("lora_dropout", 0.05, "model.lora.dropout", 0.05),
    ("lora_target", "all", "model.lora.target_modules", "all-linear"),
    ("lora_target", "q_proj,v_proj", "model.lora.target_modules", ["q_proj", "v_proj"]),
    ("additional_target", "embed_tokens,lm_head", "model.lora.modules_to_save", ["embed_tokens", "lm_head"]),
    ("use_rslora", True, "model.lora.use_rslora", True),
    ("use_dora", True, "model.lora.use_dora", True),
    ("disable_gradient_checkpointing", True, "deepspeed.activation_checkpointing", False),
    ("plot_loss", True, "tracking.plots", True),
    ("cutoff_len", 512, "data.seq_len", 512),
    ("train_on_prompt", True, "data.train_on_prompt", True),
    ("mask_history", True, "data.mask_history", True),
    ("max_samples", 100, "data.max_samples", 100),
    ("packing", True, "data.packing", True),
    ("neat_packing", True, "data.packing", True),
    ("default_system", "Be brief.", "data.system", "Be brief."),
    ("tool_format", "qwen", "data.tool_format", "qwen"),
    ("learning_rate", 2e-5, "training.lr", 2e-5),
    ("num_train_epochs", 2.0, "training.num_epochs", 2.0),
    ("max_steps", 30, "training.max_steps", 30),
    ("lr_scheduler_type", "cosine", "training.lr_schedule", "cosine"),
    ("lr_scheduler_type", "constant_with_warmup", "training.lr_schedule", "constant"),
    ("warmup_ratio", 0.1, "training.warmup_ratio", 0.1),
    ("warmup_steps", 5, "training.warmup_steps", 5),
    ("warmup_steps", 0.2, "training.warmup_ratio", 0.2),
    ("weight_decay", 0.01, "training.weight_decay", 0.01),
    ("adam_beta1", 0.8, "training.adam_beta1", 0.8),
    ("adam_beta2", 0.95, "training.adam_beta2", 0.95),
    ("adam_epsilon", 1e-6, "training.adam_eps", 1e-6),
    ("max_grad_norm", 0.5, "training.grad_clip", 0.5),
    ("seed", 7, "training.seed", 7),
    ("bf16", True, "training.precision", "bf16"),
    ("fp16", True, "training.precision", "fp16"),
    ("logging_steps", 10, "training.log_every_steps", 10),
    ("save_steps", 50, "checkpoint.every_steps", 50),
    ("save_total_limit", 3, "checkpoint.keep_last", 3),
    ("run_name", "mine", "run.name", "mine"),
    ("ray_run_name", "ray-mine", "run.name", "ray-mine"),
    ("per_device_train_batch_size", 4, "training.micro_batch_size", 4),
    ("gradient_accumulation_steps", 3, "training.global_batch_size", 24),  # 8 per device x 3 x 1 worker
    ("ray_num_workers", 4, "scaling.max_workers", 4),
    ("stage", "pt", "data.source", "hf"),
    ("dataset", "identity,alpaca_en_demo", "data.dataset", ["identity", "alpaca_en_demo"]),
    ("model_revision", "main", "model.pretrained", "<snapshot>"),
    ("do_train", True, "model.pretrained", "<snapshot>"),
    ("optim", "adamw_torch_fused", "training.lr", 5e-5),
    ("save_strategy", "steps", "checkpoint.every_steps", 500),
    ("report_to", "mlflow", "training.lr", 5e-5),
    ("mix_strategy", "concat", "data.dataset", ["identity"]),
    ("val_size", 0.0, "training.lr", 5e-5),
    ("lr_scheduler_kwargs", {"min_lr_rate": 0.1}, "training.lr", 5e-5),
    ("template", "qwen3_nothink", "model.pretrained", "<snapshot>"),
    ("cache_dir", None, "model.pretrained", "<snapshot>"),
    ("dataset_dir", "data", "data.dataset_dir", "<work>/data"),
    ("deepspeed", "examples/deepspeed/ds_z3_config.json", "deepspeed.zero_stage", 3),
    ("output_dir", "saves/x", "run.dir", "<work>/saves/x"),
    ("overwrite_output_dir", False, "run.name", "trainer_output"),
    ("model_name_or_path", MODEL_ID, "model.pretrained", "<snapshot>"),
]


@pytest.mark.parametrize(("key", "value", "target", "expected"), MAPPED_CASES)
def test_each_mapped_key_becomes_its_elastictrain_key(work, key, value, target, expected):
    got = native(work, **{key: value})
    if expected == "<snapshot>":
        expected = str(
            Path(work).parent / "hub" / "models--Qwen--Qwen3-4B-Instruct-2507" / "snapshots" / COMMIT
        )
    elif isinstance(expected, str) and expected.startswith("<work>"):
        expected = str(work / expected.removeprefix("<work>/"))
    assert got[target] == expected


def test_every_mapped_key_of_the_table_has_a_case_above():
    from test_llamafactory_preference import PREFERENCE_CASES  # stage dpo and kto's keys

    covered = {case[0] for case in MAPPED_CASES} | {case[0] for case in PREFERENCE_CASES}
    assert {k.name for k in KEYS if k.kind == MAPPED} - covered == set()


def test_keys_not_given_take_llamafactorys_defaults(work):
    got = native(work)
    assert got == got | {
        "data.source": "sft",
        "data.seq_len": 2048,  # cutoff_len
        "data.packing": False,  # stage sft packs only when asked
        "data.train_on_prompt": False,
        "data.mask_history": False,
        "data.dataset_dir": str(work / "data"),
        "model.lora.enabled": True,  # finetuning_type: lora
        "model.lora.r": 8,
        "model.lora.alpha": 16.0,  # twice the rank
        "model.lora.dropout": 0.0,
        "model.lora.target_modules": "all-linear",
        "model.lora.export_dir": "${run.dir}",  # the adapter at output_dir's top
        "deepspeed.activation_checkpointing": True,  # gradient checkpointing unless disabled
        "deepspeed.zero_stage": 1,  # no DeepSpeed file: DDP's update, as ZeRO-1
        "training.lr": 5e-5,
        "training.num_epochs": 3.0,
        "training.lr_schedule": "linear",
        "training.min_lr": 0.0,
        "training.warmup_steps": 0,
        "training.weight_decay": 0.0,
        "training.adam_beta1": 0.9,
        "training.adam_beta2": 0.999,
        "training.adam_eps": 1e-8,
        "training.grad_clip": 1.0,
        "training.seed": 42,
        "training.precision": "fp32",
        "training.micro_batch_size": 8,
        "training.global_batch_size": 8,  # 8 x 1 x one worker (no GPU here)
        "training.log_every_steps": 500,
        "checkpoint.every_steps": 500,
        "tracking.plots": False,
        "scaling.min_workers": 1,
        "scaling.max_workers": 1,
        "run.dir": str(work / "trainer_output"),
    }
    assert "data.system" not in got and "scaling.use_gpu" not in got


def test_stage_pt_packs_plain_text_from_its_dataset_info_entry(work):
    got = native(work, stage="pt", dataset="c4_demo", cutoff_len=64)
    assert got["data.source"] == "hf" and got["data.packing"] is True and got["data.seq_len"] == 64
    assert got["data.path"] == str(work / "data" / "c4_demo.jsonl") and got["data.text_field"] == "text"
    assert got["data.tokenizer"] == got["model.pretrained"]


def test_the_global_batch_is_per_device_times_accumulation_times_the_starting_world_size(work):
    t = translate(minimal(per_device_train_batch_size=2, gradient_accumulation_steps=4), cwd=work, gpus=8)
    batch = t.native["training"]["global_batch_size"]
    assert batch == 64 and t.native["scaling"]["max_workers"] == 8 and t.native["scaling"]["use_gpu"] is True
    assert any(
        "global batch 64 = per_device_train_batch_size 2 x gradient_accumulation_steps 4 x 8" in n
        for n in t.notices
    )
    given = translate(minimal(per_device_train_batch_size=2), ["scaling.max_workers=3"], cwd=work, gpus=0)
    assert given.native["training"]["global_batch_size"] == 6 and given.overrides == ["scaling.max_workers=3"]


def test_overrides_in_the_files_own_keys_apply_before_the_dotted_ones(work):
    t = translate(minimal(lora_rank=8), ["lora_rank=32", "checkpoint.keep_last=5"], cwd=work, gpus=0)
    assert t.native["model"]["lora"]["r"] == 32 and t.native["model"]["lora"]["alpha"] == 64.0
    assert t.overrides == ["checkpoint.keep_last=5"]


REFUSED_VALUES = {"adapter_name_or_path": "saves/a", "moe_aux_loss_coef": 0.01, "rope_scaling": "linear"}


@pytest.mark.parametrize("key", [k for k in KEYS if k.kind == REFUSED], ids=lambda k: k.name)
def test_each_refused_key_is_named_with_what_to_use_instead(work, key):
    value = REFUSED_VALUES.get(key.name, True if key.default in (False, None) else "other")
    t = translate(minimal(**{key.name: value}), cwd=work, gpus=0)
    assert [p for p in t.problems if p.startswith(f"{key.name}: got {value!r}; not supported: {key.note}")]


def test_refused_keys_at_their_default_value_are_fine(work):
    given = {k.name: k.default for k in KEYS if k.kind == REFUSED}
    assert translate(minimal(**given), cwd=work, gpus=0).problems == []


@pytest.mark.parametrize(
    ("keys", "says"),
    [
        ({"stage": "ppo"}, "stage: got 'ppo'; PPO is not supported yet"),
        ({"stage": "rm"}, "stage: got 'rm'; reward modelling is not supported yet"),
        ({"finetuning_type": "freeze"}, "finetuning_type: got 'freeze'; expected lora or full"),
        ({"lr_scheduler_type": "polynomial"}, "lr_scheduler_type: got 'polynomial'; expected one of linear"),
        ({"optim": "adafactor"}, "optim: got 'adafactor'; expected adamw_torch"),
        ({"template": "qwen2_vl"}, "template: got 'qwen2_vl'; a multimodal template"),
        ({"template": "alpaca"}, "template: got 'alpaca'; LLaMA-Factory's own 'alpaca' format"),
        ({"template": "no_such"}, "template: got 'no_such'; not one of LLaMA-Factory's template names"),
        ({"tool_format": "glm4"}, "tool_format: got 'glm4'; elastictrain renders tool calls"),
        ({"val_size": 0.1}, "val_size: got 0.1; LLaMA-Factory validates on the whole held-out set"),
        ({"do_train": False}, "do_train: got False; nothing would train"),
        (
            {"dataset_dir": "REMOTE:llamafactory/demo_data"},
            "dataset_dir: got 'REMOTE:llamafactory/demo_data'",
        ),
        (
            {"lora_rnak": 8},
            "lora_rnak: not a LLaMA-Factory key elastictrain reads; did you mean 'lora_rank'?",
        ),
        (
            {"stage": "pt", "dataset": "c4_demo,identity"},
            "dataset: got 'c4_demo,identity'; stage pt reads one",
        ),
    ],
)
def test_values_that_cannot_be_honoured_are_refused_by_name(work, keys, says):
    problems = translate(minimal(**keys), cwd=work, gpus=0).problems
    assert any(p.startswith(says) for p in problems), problems


def test_keys_without_effect_here_are_said_at_start_with_their_reason(work):
    t = translate(
        minimal(ddp_timeout=180000000, dataloader_num_workers=4, trust_remote_code=True), cwd=work, gpus=0
    )
    for name in ("ddp_timeout", "dataloader_num_workers", "trust_remote_code"):
        key = lf_keys.BY_NAME[name]
        assert key.kind == NO_EFFECT and f"{name}: no effect here ({key.note})" in t.notices


def test_a_template_name_stands_for_the_tokenizers_own_template_and_brings_its_default_system(work):
    t = translate(minimal(template="qwen"), cwd=work, gpus=0)
    assert (
        t.native["data"]["system"] == "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    )
    assert any(n.startswith("template qwen: the tokenizer's own chat template") for n in t.notices)
    own = translate(minimal(template="qwen", default_system="Mine."), cwd=work, gpus=0)
    assert own.native["data"]["system"] == "Mine."
    thinking = translate(minimal(template="qwen3"), cwd=work, gpus=0)
    assert any("enable_thinking is not applied" in n for n in thinking.notices)


def test_a_template_name_with_a_tokenizer_that_has_none_is_refused_naming_the_key(
    tmp_path, model, monkeypatch
):
    bare = tmp_path / "bare"
    import shutil

    shutil.copytree(model, bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    write_data(tmp_path / "data")
    problems = translate(
        minimal(model_name_or_path=str(bare), template="qwen"), cwd=tmp_path, gpus=0
    ).problems
    assert any(p.startswith("template: got 'qwen'; the tokenizer of model_name_or_path") for p in problems)


def test_a_hub_id_missing_from_the_cache_names_the_id_the_cache_and_the_download_command(
    work, tmp_path, monkeypatch
):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    problems = translate(minimal(model_name_or_path="Org/Absent-7B"), cwd=work, gpus=0).problems
    assert problems and "'Org/Absent-7B'" in problems[0] and str(tmp_path / "empty-hub") in problems[0]
    assert "`hf download Org/Absent-7B`" in problems[0]


def test_a_native_config_names_a_hub_id_and_records_its_snapshot(work):
    cfg = load_config(
        None, [f"model.pretrained={MODEL_ID}", "data.source=sft", "data.path=data/identity.json"]
    )
    assert cfg.model.pretrained.endswith(f"models--Qwen--Qwen3-4B-Instruct-2507/snapshots/{COMMIT}")
    assert f"pretrained: {cfg.model.pretrained}" in to_yaml(cfg)


def test_a_hub_id_reads_the_snapshot_its_revision_names(work, tmp_path, model):
    other = cache_model(Path(work).parent / "hub", model, "Org/Other")
    (other.parent.parent / "refs" / "v2").write_text(COMMIT)
    t = translate(minimal(model_name_or_path="Org/Other", model_revision="v2"), cwd=work, gpus=0)
    assert t.native["model"]["pretrained"] == str(other)
    missing = translate(minimal(model_name_or_path="Org/Other", model_revision="v3"), cwd=work, gpus=0)
    assert "none for revision 'v3'" in missing.problems[0] and "--revision v3" in missing.problems[0]


EXAMPLES = [
    "examples/train_lora/qwen3_lora_sft.yaml",
    "examples/train_full/qwen3_full_sft.yaml",
    "examples/train_lora/qwen3_lora_pretrain.yaml",
]


@pytest.mark.parametrize("example", EXAMPLES)
def test_llamafactorys_examples_load_unchanged_and_their_printed_config_loads_the_same(work, example):
    cfg = load_config(work / example)
    assert cfg.model.pretrained.endswith(COMMIT) and cfg.run.dir == str(
        work / yaml.safe_load((work / example).read_text())["output_dir"]
    )
    printed = work / "printed.yaml"
    printed.write_text(to_printed_yaml(cfg))
    assert load_config(printed) == cfg


def test_the_full_example_uses_its_deepspeed_file_unchanged(work):
    cfg = load_config(work / "examples/train_full/qwen3_full_sft.yaml")
    assert cfg.deepspeed.config_file == str(work / "examples/deepspeed/ds_z3_config.json")
    assert cfg.deepspeed.zero_stage == 3 and cfg.model.lora.enabled is False
    assert cfg.training.global_batch_size == 2 and cfg.training.lr_schedule == "cosine"  # 1 x 2 x 1 worker


def test_a_refusal_names_the_file(work):
    path = work / "bad.yaml"
    path.write_text(yaml.safe_dump(minimal(quantization_bit=4)))
    with pytest.raises(
        ConfigError, match=r"LLaMA-Factory file .*bad.yaml: quantization_bit: got 4; not supported"
    ):
        load_config(path)


def test_past_the_warm_up_the_schedules_equal_transformers_own(work):
    """transformers' LR at step s+1 (its step 0 trains at LR 0) is elastictrain's at step s, warm-up
    included; past the warm-up the two are the same function of the step."""
    import torch
    from transformers import get_scheduler

    from elastictrain.core.schedule import learning_rate

    for kind in ("linear", "cosine"):
        t = translate(minimal(lr_scheduler_type=kind, warmup_steps=3, max_steps=20), cwd=work, gpus=0).native
        tr = t["training"]
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=tr["lr"])
        hf = get_scheduler(kind, opt, num_warmup_steps=3, num_training_steps=20)
        theirs = []
        for _ in range(20):
            theirs.append(opt.param_groups[0]["lr"])
            opt.step()
            hf.step()
        ours = [
            learning_rate(
                s, lr=tr["lr"], min_lr=tr["min_lr"], warmup_steps=3, max_steps=20, schedule=tr["lr_schedule"]
            )
            for s in range(20)
        ]
        assert all(
            math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15) for a, b in zip(ours[3:], theirs[3:], strict=True)
        )
        assert theirs[0] == 0.0 and ours[0] == tr["lr"] / 3  # the one difference: docs/guides say so


# Every text-model training file of LLaMA-Factory's examples, and what it meets here.
TRAINING_FILES = {
    "train_lora/qwen3_lora_sft.yaml": None,
    "train_lora/qwen3_lora_sft_ds3.yaml": None,
    "train_full/qwen3_full_sft.yaml": None,
    "train_lora/qwen3_lora_pretrain.yaml": None,
    "train_lora/qwen3_lora_sft_ray.yaml": "dataset_dir: got 'REMOTE:llamafactory/demo_data'",
    "train_lora/qwen3_lora_dpo.yaml": None,
    "train_lora/qwen3_lora_kto.yaml": None,
    "train_lora/qwen3_lora_reward.yaml": "stage: got 'rm'; reward modelling is not supported yet",
    "train_lora/qwen3_preprocess.yaml": "tokenized_path: got 'saves/qwen3-4b/dataset/sft'; not supported",
}


@pytest.mark.parametrize(("name", "refusal"), TRAINING_FILES.items())
def test_every_key_of_llamafactorys_example_training_files_is_read(work, name, refusal):
    raw = yaml.safe_load((work / "examples" / name).read_text())
    t = translate(raw, cwd=work, gpus=0)
    assert not [p for p in t.problems if "not a LLaMA-Factory key" in p]
    if refusal is None:
        assert t.problems == []
    else:
        assert [p for p in t.problems if p.startswith(refusal)], t.problems


def test_every_key_of_llamafactorys_example_merge_files_is_read(work):
    from elastictrain.config.llamafactory.export_file import read_merge_file

    (work / "saves/qwen3-4b/full/sft").mkdir(parents=True)
    (work / "saves/qwen3-4b/full/sft/run.json").write_text("{}")  # a full fine-tune's run folder
    (work / "saves/qwen3-4b/lora/sft").mkdir(parents=True)
    (work / "saves/qwen3-4b/lora/sft/run.json").write_text("{}")
    lora = read_merge_file(
        yaml.safe_load((work / "examples/merge_lora/qwen3_lora_sft.yaml").read_text()), work
    )
    assert lora.problems == [] and lora.run == str(work / "saves/qwen3-4b/lora/sft")
    assert lora.base.endswith(COMMIT) and lora.out == str(work / "saves/qwen3_sft_merged")
    assert lora.max_shard_size == "5GB"
    full = read_merge_file(
        yaml.safe_load((work / "examples/merge_lora/qwen3_full_sft.yaml").read_text()), work
    )
    assert full.problems == [] and full.run == str(work / "saves/qwen3-4b/full/sft") and full.adapter is None
    gptq = read_merge_file(yaml.safe_load((work / "examples/merge_lora/qwen3_gptq.yaml").read_text()), work)
    assert [p for p in gptq.problems if p.startswith("export_quantization_bit: got 4; not supported")]


def test_print_config_of_a_llamafactory_file_says_it_starts_over_and_loads_back(work, tmp_path):
    from typer.testing import CliRunner

    from elastictrain.cli.app import app
    from elastictrain.cli.train import _llamafactory_starts_over

    example = work / "examples/train_lora/qwen3_lora_sft.yaml"
    result = CliRunner().invoke(app, ["train", "-c", str(example), "--print-config"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(
        "# overwrite_output_dir: true in the LLaMA-Factory file: train this with --fresh"
    )
    printed = tmp_path / "printed.yaml"
    printed.write_text(result.output)
    assert load_config(printed) == load_config(example)
    assert _llamafactory_starts_over(example, []) is True
    assert _llamafactory_starts_over(example, ["overwrite_output_dir=false"]) is False
    assert _llamafactory_starts_over(printed, []) is False  # the native form: --fresh says it
    assert not (work / "saves").exists()  # --print-config creates no run folder


def test_llamafactorys_tool_call_demo_is_refused_by_a_template_dropping_calls_and_trains_with_tool_format(
    work,
):
    from test_sft_tool_calls import RECORDS, assert_calls_trained_and_tools_prompted

    from elastictrain.data.sft.dataset import SftDataError, build_sft_dataset

    (work / "data/glaive_toolcall_en_demo.json").write_text(json.dumps(RECORDS))
    info = json.loads((work / "data/dataset_info.json").read_text())
    info["glaive_toolcall_en_demo"] = {  # as LLaMA-Factory's own data/dataset_info.json has it
        "file_name": "glaive_toolcall_en_demo.json",
        "formatting": "sharegpt",
        "columns": {"messages": "conversations", "tools": "tools"},
    }
    (work / "data/dataset_info.json").write_text(json.dumps(info))
    path = work / "tools.yaml"
    path.write_text(
        yaml.safe_dump(minimal(dataset="glaive_toolcall_en_demo", template="qwen", cutoff_len=4096))
    )
    cfg = load_config(path)  # the cached model's tokenizer: a plain ChatML template, blind to tool calls
    with pytest.raises(SftDataError, match=r"would train without their tool calls(.|\n)*data.tool_format"):
        build_sft_dataset(cfg.data, cfg.model.pretrained)
    cfg = load_config(path, ["tool_format=qwen", "default_system=null"])
    from transformers import AutoTokenizer

    dataset = build_sft_dataset(cfg.data, cfg.model.pretrained)
    assert_calls_trained_and_tools_prompted(AutoTokenizer.from_pretrained(cfg.model.pretrained), dataset)
