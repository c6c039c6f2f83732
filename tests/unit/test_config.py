"""Config loading and validation: every bad input names the field, the value and what is valid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastictrain.config import (
    ConfigError,
    config_digest,
    load_config,
    to_flat_dict,
    to_yaml,
    valid_world_sizes,
)
from elastictrain.config.deepspeed_config import build_deepspeed_config

CONF = Path(__file__).resolve().parents[2] / "conf"


def problems(*overrides: str, path: Path | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    return str(e.value)


def test_defaults_load_and_equal_the_embedded_default_file():
    assert load_config(None) == load_config(CONF / "tiny-cpu.yaml")


@pytest.mark.parametrize(
    "name",
    ["tiny-cpu.yaml", "gpu-llama-1b.yaml"] + [f"llama-{s}.yaml" for s in ("30m", "125m", "350m", "1b")],
)
def test_shipped_configs_load_and_validate_and_every_end_of_their_worker_range_splits_the_batch(name):
    cfg = load_config(CONF / name)
    sizes = valid_world_sizes(cfg)
    # A max_workers the global batch does not split is never used: the range would promise what it is not.
    assert sizes and sizes[0] == cfg.scaling.min_workers and sizes[-1] == cfg.scaling.max_workers, sizes


def test_dotlist_overrides_apply_and_interpolations_resolve():
    cfg = load_config(
        CONF / "tiny-cpu.yaml", ["training.max_steps=7", "run.name=exp1", "scaling.max_workers=3"]
    )
    assert cfg.training.max_steps == 7 and cfg.scaling.max_workers == 3
    assert cfg.run.dir == "runs/exp1"


def test_a_full_hf_config_in_a_file_replaces_the_default_model(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(
        "model:\n  hf_config:\n    model_type: gpt2\n    n_embd: 64\n    n_layer: 2\n    n_head: 2\n"
        "    vocab_size: 256\n    n_positions: 128\n"
    )
    cfg = load_config(f)
    assert "num_key_value_heads" not in cfg.model.hf_config and cfg.model.hf_config["model_type"] == "gpt2"


def test_unknown_keys_are_errors_that_suggest_the_close_match(tmp_path):
    assert "unknown key 'training.max_stepz'; did you mean 'training.max_steps'?" in problems(
        "training.max_stepz=3"
    )
    f = tmp_path / "c.yaml"
    f.write_text("trainin:\n  lr: 1\n")
    assert "unknown key 'trainin'; did you mean 'training'?" in problems(path=f)
    assert "valid keys of scaling" in problems("scaling.zzz=1")


def test_all_problems_are_reported_at_once():
    text = problems("training.max_stepz=3", "training.lr=abc")
    assert "training.max_stepz" in text and "training.lr: got 'abc'; expected a number" in text


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("training.max_steps=abc", "training.max_steps: got 'abc'; expected an integer"),
        ("training.max_steps=0", "training.max_steps: got 0; expected a number >= 1"),
        ("failure.loss_spike=0.5", "failure.loss_spike: got 0.5; expected 0 (off) or a factor > 1, e.g. 3"),
        ("failure.max_bad_steps=-1", "failure.max_bad_steps: got -1; expected a number >= 0"),
        ("failure.loss_spike_window=2", "failure.loss_spike_window: got 2; expected a number >= 3"),
        ("training.lr=0", "training.lr: got 0.0; expected a number > 0"),
        ("training.lr=-1", "training.lr: got -1.0; expected a number > 0"),
        ("training.min_lr=0.5", "training.min_lr: got 0.5; expected <= training.lr"),
        ("training.warmup_steps=100", "training.warmup_steps: got 100; expected <= training.max_steps (40)"),
        (
            "training.lr_schedule=exp",
            "training.lr_schedule: got 'exp'; expected one of cosine, linear, constant",
        ),
        ("training.precision=fp8", "training.precision: got 'fp8'; expected one of fp32, bf16, fp16"),
        ("training.adam_beta1=1.5", "training.adam_beta1: got 1.5; expected a number in [0, 1)"),
        ("training.adam_eps=0", "training.adam_eps: got 0.0; expected a number > 0"),
        ("training.grad_clip=-1", "training.grad_clip: got -1.0; expected a number >= 0"),
        ("training.micro_batch_size=0", "training.micro_batch_size: got 0; expected a number >= 1"),
        ("training.global_batch_size=0", "training.global_batch_size: got 0; expected a number >= 1"),
        ("training.log_every_steps=0", "training.log_every_steps: got 0; expected a number >= 1"),
        ("scaling.min_workers=3", "scaling.min_workers: got 3; expected <= scaling.max_workers (2)"),
        ("scaling.min_workers=0", "scaling.min_workers: got 0; expected a number >= 1"),
        ("scaling.spare_workers=-1", "scaling.spare_workers: got -1; expected a number >= 0"),
        ("scaling.keep_warm_s=-5", "scaling.keep_warm_s: got -5.0; expected a number >= 0"),
        ("scaling.cpus_per_worker=0", "scaling.cpus_per_worker: got 0.0; expected a number > 0"),
        ("scaling.use_gpu=maybe", "scaling.use_gpu: got 'maybe'; expected true or false"),
        ("deepspeed.zero_stage=4", "deepspeed.zero_stage: got 4; expected one of 0, 1, 2, 3"),
        (
            "deepspeed.offload_optimizer=disk",
            "deepspeed.offload_optimizer: got 'disk'; expected one of none, cpu, nvme",
        ),
        (
            "deepspeed.offload_param=ssd",
            "deepspeed.offload_param: got 'ssd'; expected one of none, cpu, nvme",
        ),
        ("deepspeed.offload_optimizer=nvme", "deepspeed.nvme_path: missing; expected a writable folder"),
        ("data.source=web", "data.source: got 'web'; expected one of generated, file"),
        ("data.source=file", "data.path: missing; expected a UTF-8 text file"),
        ("data.seq_len=1", "data.seq_len: got 1; expected a number >= 2"),
        (
            "data.seq_len=4096",
            "data.seq_len: got 4096; expected <= model.hf_config.max_position_embeddings (128)",
        ),
        ("checkpoint.every_steps=0", "checkpoint.every_steps: got 0; expected a number >= 1"),
        ("checkpoint.keep_last=0", "checkpoint.keep_last: got 0; expected a number >= 1"),
        ("failure.max_failures=-1", "failure.max_failures: got -1; expected a number >= 0"),
        ("failure.hang_timeout_s=0", "failure.hang_timeout_s: got 0.0; expected a number > 0"),
        ("failure.collective_timeout_s=-5", "failure.collective_timeout_s: got -5.0; expected a number > 0"),
        ("model.hf_config.vocab_size=100", "model.hf_config.vocab_size: got 100; expected >= 256"),
        ("run.name=a/b", "run.name: got 'a/b'; expected a non-empty name without '/'"),
        ("ray.num_cpus=0", "ray.num_cpus: got 0; expected a number >= 1"),
        ("notakey", "override 'notakey': expected key=value"),
    ],
)
def test_bad_values_name_the_field_the_value_and_what_is_valid(override, expected):
    assert expected in problems(override)


def test_nvme_path_must_exist_and_be_a_folder(tmp_path):
    missing = tmp_path / "nope"
    text = problems("deepspeed.offload_optimizer=nvme", f"deepspeed.nvme_path={missing}")
    assert f"deepspeed.nvme_path: got '{missing}'; expected an existing folder" in text
    cfg = load_config(None, ["deepspeed.offload_optimizer=nvme", f"deepspeed.nvme_path={tmp_path}"])
    assert cfg.deepspeed.nvme_path == str(tmp_path)


def test_param_offload_without_optimizer_offload_is_refused():
    assert "needs deepspeed.offload_optimizer" in problems("deepspeed.offload_param=cpu")


def test_a_global_batch_no_world_size_can_split_lists_ones_that_work():
    text = problems("training.global_batch_size=25", "scaling.min_workers=2", "scaling.max_workers=3")
    assert "training.global_batch_size: got 25; no world size in [scaling.min_workers=2, " in text
    assert "24" in text and "30" in text


def test_valid_world_sizes_skips_sizes_that_do_not_split():
    cfg = load_config(None, ["scaling.min_workers=1", "scaling.max_workers=6"])
    assert valid_world_sizes(cfg) == [1, 2, 3, 4, 6]


def test_missing_or_broken_config_file_is_a_clear_error(tmp_path):
    assert "does not exist" in problems(path=tmp_path / "none.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("training: [1, 2\n")
    assert "not valid YAML" in problems(path=bad)


def test_digest_is_stable_and_changes_with_any_value():
    a, b = load_config(None), load_config(None)
    assert config_digest(a) == config_digest(b)
    assert config_digest(a) != config_digest(load_config(None, ["training.lr=0.001"]))


def test_flat_dict_flattens_nested_sections_and_the_model_config():
    flat = to_flat_dict(load_config(None))
    assert flat["training.global_batch_size"] == 24
    assert flat["model.hf_config.model_type"] == "llama"
    assert "deepspeed.extra" not in flat or flat["deepspeed.extra"] == {}


def test_yaml_round_trips(tmp_path):
    cfg = load_config(None, ["training.max_steps=9"])
    f = tmp_path / "c.yaml"
    f.write_text(to_yaml(cfg))
    assert load_config(f) == cfg


# ---- DeepSpeed config ----


def _has_auto(node) -> bool:  # noqa: ANN001
    if isinstance(node, dict):
        return any(_has_auto(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_auto(v) for v in node)
    return node == "auto"


@pytest.mark.parametrize("offload", ["none", "cpu", "nvme"])
def test_generated_deepspeed_config_per_offload(tmp_path, offload):
    cfg = load_config(
        None,
        [
            f"deepspeed.offload_optimizer={offload}",
            f"deepspeed.offload_param={offload}",
            f"deepspeed.nvme_path={tmp_path}",
        ],
    )
    ds = build_deepspeed_config(cfg, 4, 3, 2)
    assert (
        ds["train_batch_size"],
        ds["train_micro_batch_size_per_gpu"],
        ds["gradient_accumulation_steps"],
    ) == (24, 4, 3)
    assert "scheduler" not in ds
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3
    if offload == "none":
        params = ds["optimizer"]["params"]
        assert params["torch_adam"] is True and params["fused"] is True and "offload_optimizer" not in zero
    else:
        assert zero["offload_optimizer"]["device"] == offload and zero["offload_param"]["device"] == offload
    if offload == "nvme":
        assert zero["offload_param"]["nvme_path"] == str(tmp_path) and "aio" in ds


@pytest.mark.parametrize(("precision", "key"), [("fp16", "fp16"), ("bf16", "bf16")])
def test_precision_enables_the_matching_deepspeed_block(precision, key):
    ds = build_deepspeed_config(load_config(None, [f"training.precision={precision}"]), 4, 3, 2)
    assert ds[key]["enabled"] is True


def test_extra_keys_are_merged_last():
    cfg = (
        load_config(None, ["+deepspeed.extra.zero_optimization.overlap_comm=true"])
        if False
        else load_config(
            None, ["deepspeed.extra={zero_optimization: {overlap_comm: true}, steps_per_print: 5}"]
        )
    )
    ds = build_deepspeed_config(cfg, 4, 3, 2)
    assert ds["zero_optimization"]["overlap_comm"] is True and ds["steps_per_print"] == 5


def test_user_json_with_auto_values_is_fully_resolved():
    cfg = load_config(
        None, [f"deepspeed.config_file={CONF / 'deepspeed' / 'zero3-auto.json'}", "training.precision=bf16"]
    )
    ds = build_deepspeed_config(cfg, 2, 4, 3)
    assert not _has_auto(ds)
    assert ds["train_micro_batch_size_per_gpu"] == 2 and ds["gradient_accumulation_steps"] == 4
    assert ds["optimizer"]["params"]["lr"] == cfg.training.lr
    assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
    assert ds["zero_optimization"]["reduce_bucket_size"] == 64 * 64
    assert "scheduler" not in ds  # training.lr_schedule owns the LR


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ({"train_batch_size": 32}, "train_batch_size is 32 in ds.json but training.global_batch_size is 24"),
        ({"train_micro_batch_size_per_gpu": 8}, "train_micro_batch_size_per_gpu is 8"),
        ({"fp16": {"enabled": True}}, "fp16.enabled is true in ds.json but training.precision is fp32"),
        ({"scheduler": {"type": "OneCycle"}}, "scheduler type 'OneCycle' is not supported"),
        (
            {"zero_optimization": {"stage": 5}},
            "zero_optimization.stage is 5 in ds.json; expected 0, 1, 2 or 3",
        ),
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
            "in ds.json: deepspeed.offload_optimizer: got 'nvme' with deepspeed.zero_stage 2",
        ),
        ({"foo": {"bar": "auto"}}, '"auto" at foo.bar in ds.json cannot be resolved'),
    ],
)
def test_conflicting_user_json_is_refused_naming_the_key(tmp_path, content, expected):
    f = tmp_path / "ds.json"
    f.write_text(json.dumps(content))
    assert expected in problems(f"deepspeed.config_file={f}")


def test_an_optimizer_whose_state_cannot_be_resharded_is_refused_only_when_the_world_size_changes(tmp_path):
    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"optimizer": {"type": "OneBitAdam"}}))
    elastic = problems(f"deepspeed.config_file={f}", "scaling.max_workers=3")
    assert "optimizer type 'OneBitAdam' keeps state that depends on the world size" in elastic
    assert "scaling.min_workers == scaling.max_workers" in elastic
    load_config(None, [f"deepspeed.config_file={f}"])  # min_workers == max_workers: accepted


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["deepspeed.zero_stage=2", "deepspeed.offload_optimizer=cpu", "deepspeed.offload_param=cpu"],
            "deepspeed.offload_param: got 'cpu' with deepspeed.zero_stage 2; offloading parameters needs",
        ),
        (
            ["deepspeed.zero_stage=1", "deepspeed.offload_optimizer=nvme", "deepspeed.nvme_path=/tmp"],
            "NVMe only in ZeRO stage 3",
        ),
        (
            ["deepspeed.zero_stage=0", "deepspeed.offload_optimizer=cpu"],
            "optimizer offload needs ZeRO stage 1, 2 or 3",
        ),
        (
            ["deepspeed.zero_stage=0", "training.precision=fp16"],
            "elastic checkpoints of fp16 need ZeRO stage 1-3",
        ),
        (
            ["deepspeed.zero_stage=0", "training.precision=bf16"],
            "elastic checkpoints of bf16 need ZeRO stage 1-3",
        ),
    ],
)
def test_what_a_zero_stage_cannot_do_is_refused_naming_the_fields(overrides, expected):
    assert expected in problems(*overrides)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_zero_stage_is_accepted(stage):
    assert load_config(None, [f"deepspeed.zero_stage={stage}"]).deepspeed.zero_stage == stage


def test_user_json_that_is_missing_or_not_json(tmp_path):
    assert "expected an existing DeepSpeed JSON file" in problems(
        f"deepspeed.config_file={tmp_path / 'x.json'}"
    )
    f = tmp_path / "ds.json"
    f.write_text("{ not json")
    assert "is not valid JSON (line 1, column 3" in problems(f"deepspeed.config_file={f}")


@pytest.mark.parametrize("name", ["hf-zero2.json", "hf-zero3-offload.json"])
def test_hugging_face_style_jsons_are_accepted_with_a_one_line_notice(name):
    from elastictrain.config.deepspeed_config import owned_settings_notice

    cfg = load_config(CONF / "tiny-cpu.yaml", [f"deepspeed.config_file={CONF / 'deepspeed' / name}"])
    notice = owned_settings_notice(cfg)
    assert notice is not None and "\n" not in notice
    assert "train_batch_size" in notice and "set by elastictrain" in notice
    ds = build_deepspeed_config(cfg, 2, 6, 2)
    assert ds["optimizer"]["type"] == "AdamW" and ds["optimizer"]["params"]["lr"] == cfg.training.lr
    assert "scheduler" not in ds and ds["gradient_clipping"] == cfg.training.grad_clip
    assert ds["train_micro_batch_size_per_gpu"] == 2 and ds["gradient_accumulation_steps"] == 6


def test_a_negative_snapshot_memory_bound_is_refused_naming_the_field():
    assert "checkpoint.max_host_memory_mb: got -1" in problems("checkpoint.max_host_memory_mb=-1")


def test_generated_zero3_buffers_are_sized_to_the_model_not_deepspeed_defaults():
    cfg = load_config(CONF / "llama-125m.yaml")
    zero = build_deepspeed_config(cfg, 1, 3, 2)["zero_optimization"]
    assert zero["stage3_max_live_parameters"] == zero["stage3_max_reuse_distance"] == 20 * 768 * 768
    assert zero["reduce_bucket_size"] == 1 << 22  # hidden^2 is below the floor: 4M elements, not 5e8
    wide = load_config(CONF / "llama-125m.yaml", ["model.hf_config.hidden_size=4096"])
    assert build_deepspeed_config(wide, 1, 3, 2)["zero_optimization"]["reduce_bucket_size"] == 4096 * 4096


def test_every_layout_field_takes_auto_and_its_valid_values_are_named():
    cfg = load_config(
        None,
        [
            "deepspeed.zero_stage=auto",
            "deepspeed.offload_optimizer=auto",
            "deepspeed.offload_param=auto",
            "deepspeed.activation_checkpointing=auto",
            "training.micro_batch_size=auto",
        ],
    )
    assert cfg.deepspeed.zero_stage == cfg.training.micro_batch_size == "auto"
    assert "deepspeed.zero_stage: got 'automatic'; expected one of 0, 1, 2, 3, auto" in problems(
        "deepspeed.zero_stage=automatic"
    )
    expected = "deepspeed.activation_checkpointing: got 'sometimes'; expected one of True, False, auto"
    assert expected in problems("deepspeed.activation_checkpointing=sometimes")


def test_auto_layout_fields_are_refused_where_the_choice_cannot_be_made(tmp_path):
    user_json = tmp_path / "ds.json"
    user_json.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    assert "deepspeed.zero_stage: got 'auto' with deepspeed.config_file; your JSON's zero_optimization" in (
        problems("deepspeed.zero_stage=auto", f"deepspeed.config_file={user_json}")
    )
    assert "training.micro_batch_size: got 'auto' with model.factory" in problems(
        "training.micro_batch_size=auto", "model.factory=json:loads"
    )
