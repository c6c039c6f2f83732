"""LLaMA-Factory's preference training files (stage dpo, kto) read with LLaMA-Factory's meaning: each
preference key, its defaults, what is refused or has no effect, and its own example files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from integration.pretrained_models import make_pretrained
from llamafactory_workdir import COMMIT, MODEL_ID, make_workdir

from elastictrain.config import load_config, to_printed_yaml
from elastictrain.config.llamafactory import translate

QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


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


def preference_file(stage: str = "dpo", **keys: Any) -> dict[str, Any]:
    dataset = "dpo_en_demo" if stage == "dpo" else "kto_en_demo"
    return {"stage": stage, "do_train": True, "model_name_or_path": MODEL_ID, "dataset": dataset, **keys}


def flat(node: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in node.items():
        if isinstance(v, dict) and k != "hf_config":
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def native(work: Path, stage: str = "dpo", **keys: Any) -> dict[str, Any]:
    t = translate(preference_file(stage, **keys), cwd=work, gpus=0)
    assert not t.problems, t.problems
    return flat(t.native)


def snapshot(work: Path) -> str:
    return str(work.parent / "hub" / "models--Qwen--Qwen3-4B-Instruct-2507" / "snapshots" / COMMIT)


ABSENT = "<absent>"
# (LLaMA-Factory key, value given, the file's other keys, elastictrain key, what it becomes): one row a key
# read at stage dpo or kto at least (test_llamafactory_config.py checks every mapped key has a row).
PREFERENCE_CASES: list[tuple[str, Any, dict[str, Any], str, Any]] = [
    ("stage", "dpo", {}, "training.objective", "dpo"),
    ("stage", "dpo", {}, "data.source", "sft"),
    ("stage", "kto", {}, "training.objective", "kto"),
    ("stage", "kto", {}, "data.source", "sft"),
    ("pref_loss", "sigmoid", {}, "preference.dpo_loss", "sigmoid"),
    ("pref_loss", "hinge", {}, "preference.dpo_loss", "hinge"),
    ("pref_loss", "ipo", {}, "preference.dpo_loss", "ipo"),
    ("pref_loss", "ipo", {}, "training.objective", "dpo"),
    ("pref_loss", "orpo", {}, "training.objective", "orpo"),
    ("pref_loss", "simpo", {}, "training.objective", "simpo"),
    ("pref_beta", 0.25, {}, "preference.beta", 0.25),
    ("pref_beta", 0.25, {"pref_loss": "orpo"}, "preference.beta", 0.25),
    ("pref_beta", 0.25, {"stage": "kto"}, "preference.beta", 0.25),
    ("pref_beta", "5e-2", {}, "preference.beta", 0.05),  # YAML 1.1 reads 5e-2 as a string
    ("pref_ftx", 0.5, {}, "preference.ftx", 0.5),
    ("pref_ftx", 0.5, {"pref_loss": "simpo"}, "preference.ftx", 0.5),
    ("pref_ftx", 0.5, {"pref_loss": "orpo"}, "preference.ftx", 0.5),
    ("pref_ftx", 0.5, {"stage": "kto"}, "preference.ftx", 0.5),
    ("dpo_label_smoothing", 0.1, {}, "preference.label_smoothing", 0.1),
    ("simpo_gamma", 1.0, {"pref_loss": "simpo"}, "preference.simpo_gamma", 1.0),
    ("kto_chosen_weight", 1.5, {"stage": "kto"}, "preference.kto_desirable_weight", 1.5),
    ("kto_rejected_weight", 0.5, {"stage": "kto"}, "preference.kto_undesirable_weight", 0.5),
    ("ref_model", MODEL_ID, {}, "training.objective", "dpo"),  # the starting model: accepted
    ("ref_model", "<snapshot>", {"stage": "kto"}, "training.objective", "kto"),  # its folder too
    ("ref_model_adapters", None, {"ref_model": MODEL_ID}, "training.objective", "dpo"),
    ("ref_model_quantization_bit", None, {"ref_model": MODEL_ID}, "training.objective", "dpo"),
    ("lora_dropout", 0.1, {}, "model.lora.dropout", 0.0),  # LLaMA-Factory's DPO turns dropout off
    ("lora_dropout", 0.1, {"stage": "kto"}, "model.lora.dropout", 0.0),
    ("packing", True, {}, "data.packing", False),
    ("neat_packing", True, {"stage": "kto"}, "data.packing", False),
    ("train_on_prompt", True, {}, "data.train_on_prompt", ABSENT),  # answers only
    ("mask_history", True, {"stage": "kto"}, "data.mask_history", ABSENT),
    ("template", "qwen", {}, "data.system", QWEN_SYSTEM),  # read at stage dpo and kto as at sft
    ("template", "qwen", {"stage": "kto"}, "data.system", QWEN_SYSTEM),
    ("dataset", "dpo_en_demo,mine", {}, "data.dataset", ["dpo_en_demo", "mine"]),
    ("dataset_dir", "data", {"stage": "kto"}, "data.dataset_dir", "<work>/data"),
]


@pytest.mark.parametrize(("key", "value", "others", "target", "expected"), PREFERENCE_CASES)
def test_each_preference_key_becomes_its_elastictrain_key(work, key, value, others, target, expected):
    keys = {**others, key: snapshot(work) if value == "<snapshot>" else value}
    got = native(work, **keys)
    if isinstance(expected, str) and expected.startswith("<work>"):
        expected = str(work / expected.removeprefix("<work>/"))
    assert got.get(target, ABSENT) == expected


def test_keys_not_given_take_llamafactorys_preference_defaults(work):
    dpo = native(work)
    assert dpo == dpo | {
        "data.source": "sft",
        "data.dataset": ["dpo_en_demo"],
        "data.dataset_dir": str(work / "data"),
        "data.packing": False,
        "training.objective": "dpo",  # pref_loss: sigmoid
        "preference.dpo_loss": "sigmoid",
        "preference.beta": 0.1,
        "preference.ftx": 0.0,
        "preference.label_smoothing": 0.0,
        "model.lora.dropout": 0.0,
    }
    assert not {"preference.simpo_gamma", "preference.kto_desirable_weight", "preference.reference"} & set(
        dpo
    )
    simpo = native(work, pref_loss="simpo")
    assert simpo["preference.simpo_gamma"] == 0.5 and "preference.dpo_loss" not in simpo
    kto = native(work, "kto")
    assert kto == kto | {
        "training.objective": "kto",
        "preference.beta": 0.1,
        "preference.kto_desirable_weight": 1.0,
        "preference.kto_undesirable_weight": 1.0,
        "data.packing": False,
    }
    assert "preference.dpo_loss" not in kto and kto["preference.ftx"] == 0.0


def test_preference_keys_at_stage_sft_have_no_effect_and_write_nothing(work):
    t = translate(
        preference_file("sft", dataset="identity", pref_beta=0.3, ref_model="Org/Other"), cwd=work, gpus=0
    )
    assert t.problems == [] and "preference" not in t.native
    assert "objective" not in t.native["training"]
    assert "pref_beta: no effect at stage sft (read at stage dpo and kto)" in t.notices
    assert "ref_model: no effect at stage sft (read at stage dpo and kto)" in t.notices


@pytest.mark.parametrize(
    ("keys", "says"),
    [
        (
            {"pref_loss": "simpo", "kto_chosen_weight": 2.0},
            "kto_chosen_weight: no effect with pref_loss simpo",
        ),
        ({"simpo_gamma": 1.0}, "simpo_gamma: no effect with pref_loss sigmoid"),
        ({"stage": "kto", "pref_loss": "orpo"}, "pref_loss: no effect at stage kto"),
        ({"stage": "kto", "dpo_label_smoothing": 0.1}, "dpo_label_smoothing: no effect with stage kto"),
        ({"pref_loss": "orpo", "ref_model": "Org/Other"}, "ref_model: no effect with pref_loss orpo"),
        ({"ref_model_adapters": "saves/a"}, "ref_model_adapters: no effect without ref_model"),
        ({"stage": "kto", "ref_model_quantization_bit": 4}, "ref_model_quantization_bit: no effect without"),
        ({"train_on_prompt": True}, "train_on_prompt: no effect at stage dpo"),
        ({"packing": True}, "packing: no effect at stage dpo"),
        ({"lora_dropout": 0.05}, "lora_dropout: 0.05 has no effect at stage dpo"),
    ],
)
def test_keys_llamafactory_does_not_read_at_a_preference_stage_are_said_to_have_no_effect(work, keys, says):
    t = translate(preference_file(**keys), cwd=work, gpus=0)
    assert t.problems == [] and [n for n in t.notices if n.startswith(says)], t.notices


STARTING_MODEL = "elastictrain's reference is the starting model itself, model_name_or_path"


@pytest.mark.parametrize(
    ("keys", "says"),
    [
        ({"pref_loss": "bco_pair"}, "pref_loss: got 'bco_pair'; expected sigmoid, hinge or ipo"),
        ({"pref_loss": "sppo_hard"}, "pref_loss: got 'sppo_hard'; expected sigmoid, hinge or ipo"),
        ({"pref_loss": "kto_pair"}, "pref_loss: got 'kto_pair'; expected sigmoid"),
        ({"pref_bco_weight": 0.5}, "pref_bco_weight: got 0.5; not supported: BCO"),
        ({"ld_alpha": 0.5}, "ld_alpha: got 0.5; not supported: LD-DPO"),
        ({"dpo_label_smoothing": 0.1, "pref_loss": "hinge"}, "dpo_label_smoothing: got 0.1; valid with"),
        ({"dpo_label_smoothing": 0.1, "pref_loss": "simpo"}, "dpo_label_smoothing: got 0.1; valid with"),
        ({"pref_beta": "strong"}, "pref_beta: got 'strong'; expected a number"),
        (
            {"ref_model": "Org/Other"},
            "ref_model: got 'Org/Other'; another reference model is not supported: ",
        ),
        ({"stage": "kto", "ref_model": "saves/sft"}, "ref_model: got 'saves/sft'; another reference model"),
        ({"ref_model": MODEL_ID, "ref_model_adapters": "saves/a"}, "ref_model_adapters: got 'saves/a'; a "),
        (
            {"ref_model": MODEL_ID, "ref_model_quantization_bit": 4},
            "ref_model_quantization_bit: got 4; a quantized reference is not supported",
        ),
        (
            {"stage": "ppo"},
            "stage: got 'ppo'; PPO is not supported yet; elastictrain trains stage sft, pt, dpo",
        ),
    ],
)
def test_preference_values_that_cannot_be_honoured_are_refused_by_name(work, keys, says):
    problems = translate(preference_file(**keys), cwd=work, gpus=0).problems
    assert [p for p in problems if p.startswith(says)], problems


def test_a_reference_model_other_than_the_starting_one_is_refused_saying_what_the_reference_is(work):
    problems = translate(preference_file(ref_model="Org/Other"), cwd=work, gpus=0).problems
    assert len(problems) == 1 and STARTING_MODEL in problems[0] and "preference.reference" in problems[0]


def write_preference_data(work: Path, n: int = 8) -> None:
    """dpo_en_demo and kto_en_demo, the datasets LLaMA-Factory's dpo and kto examples name, in the shapes
    and with the dataset_info.json entries of its own data/ folder."""
    data = work / "data"
    pairs = [
        {
            "conversations": [{"from": "human", "value": f"Question {i}: what comes after {i}?"}],
            "chosen": {"from": "gpt", "value": f"{i + 1} comes after {i}."},
            "rejected": {"from": "gpt", "value": "I would rather not say."},
        }
        for i in range(n)
    ]
    kto = [
        {
            "messages": [
                {"role": "user", "content": f"What comes after {i}?"},
                {"role": "assistant", "content": f"{i + 1}." if i % 3 else "No idea."},
            ],
            "label": bool(i % 3),
        }
        for i in range(n)
    ]
    (data / "dpo_en_demo.json").write_text(json.dumps(pairs))
    (data / "kto_en_demo.json").write_text(json.dumps(kto))
    info = json.loads((data / "dataset_info.json").read_text())
    info["dpo_en_demo"] = {
        "file_name": "dpo_en_demo.json",
        "ranking": True,
        "formatting": "sharegpt",
        "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"},
    }
    info["kto_en_demo"] = {
        "file_name": "kto_en_demo.json",
        "formatting": "sharegpt",
        "columns": {"messages": "messages", "kto_tag": "label"},
        "tags": {
            "role_tag": "role",
            "content_tag": "content",
            "user_tag": "user",
            "assistant_tag": "assistant",
        },
    }
    (data / "dataset_info.json").write_text(json.dumps(info, indent=1))


@pytest.mark.parametrize(
    ("example", "objective"),
    [("train_lora/qwen3_lora_dpo.yaml", "dpo"), ("train_lora/qwen3_lora_kto.yaml", "kto")],
)
def test_llamafactorys_preference_examples_load_and_their_printed_config_loads_the_same(
    work, example, objective
):
    write_preference_data(work)
    path = work / "examples" / example
    cfg = load_config(path)
    raw = yaml.safe_load(path.read_text())
    assert cfg.training.objective == objective and cfg.data.source == "sft" and cfg.data.packing is False
    assert cfg.preference.beta == raw["pref_beta"] and cfg.model.lora.enabled is True
    assert cfg.preference.reference == "auto"  # LoRA: the model with its adapters off, as LLaMA-Factory's
    assert cfg.run.dir == str(work / raw["output_dir"]) and cfg.model.pretrained.endswith(COMMIT)
    printed = work / "printed.yaml"
    printed.write_text(to_printed_yaml(cfg))
    assert load_config(printed) == cfg


def test_print_config_of_the_dpo_example_loads_back_as_the_same_config(work, tmp_path):
    from typer.testing import CliRunner

    from elastictrain.cli.app import app

    write_preference_data(work)
    example = work / "examples/train_lora/qwen3_lora_dpo.yaml"
    for overrides in ([], ["pref_loss=simpo", "simpo_gamma=0.8"], ["finetuning_type=full"]):
        result = CliRunner().invoke(app, ["train", "-c", str(example), *overrides, "--print-config"])
        assert result.exit_code == 0, result.output
        printed = tmp_path / "printed.yaml"
        printed.write_text(result.output)
        assert load_config(printed) == load_config(example, overrides)
    assert load_config(printed).model.lora.enabled is False  # the full fine-tune's reference: precomputed
    simpo = load_config(example, ["pref_loss=simpo", "simpo_gamma=0.8"])
    assert simpo.training.objective == "simpo" and simpo.preference.simpo_gamma == 0.8
    assert not (work / "saves").exists()  # --print-config creates no run folder
