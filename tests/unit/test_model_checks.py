"""Issue 12 points 12 and 16: the model's transformers config is built on the driver before any worker
starts; what it rejects, a misspelt key, a seq_len beyond a pretrained model's positions and a tokenizer
larger than the model's vocabulary are config errors naming the field.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from elastictrain.cli import app
from elastictrain.config import ConfigError, load_config
from elastictrain.driver.preflight import check_user_code

TINY = Path(__file__).resolve().parents[2] / "conf" / "tiny-cpu.yaml"


def config(tmp_path: Path, *overrides: str):  # noqa: ANN201
    return load_config(TINY, [f"run.dir={tmp_path}/run", *overrides])


def refusal(cfg) -> str:  # noqa: ANN001
    with pytest.raises(ConfigError) as e:
        check_user_code(cfg)
    return str(e.value)


def test_a_hidden_size_the_heads_do_not_divide_is_a_config_error_before_any_worker(tmp_path):
    text = refusal(config(tmp_path, "model.hf_config.hidden_size=30"))
    assert text == (
        "model.hf_config: transformers rejects it (llama): "
        "The hidden size (30) is not a multiple of the number of attention heads (4)."
    )


def test_the_cli_refuses_it_before_creating_the_run_folder(tmp_path):
    result = CliRunner().invoke(
        app,
        ["train", "-c", str(TINY), f"run.dir={tmp_path}/run", "model.hf_config.hidden_size=30",
         "ray.address=127.0.0.1:1", "--no-tracking"],
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    out = " ".join(result.output.split())
    assert (
        "invalid configuration: model.hf_config: transformers rejects it (llama): The hidden size (30)" in out
    )
    assert not (tmp_path / "run").exists()


def test_a_misspelt_hf_config_key_says_did_you_mean(tmp_path):
    text = refusal(config(tmp_path, "model.hf_config.hiden_size=64"))
    assert text == (
        "model.hf_config.hiden_size: not a setting of LlamaConfig (model_type 'llama'), so transformers "
        "would ignore it; did you mean 'hidden_size'?"
    )


def test_an_unknown_model_type_says_did_you_mean(tmp_path):
    text = refusal(config(tmp_path, "model.hf_config.model_type=lama"))
    assert (
        text == "model.hf_config.model_type: got 'lama'; not a transformers model type; did you mean 'llama'?"
    )


def test_a_wrong_type_inside_hf_config_names_the_field(tmp_path):
    text = refusal(config(tmp_path, "model.hf_config.num_hidden_layers=two"))
    assert (
        text.startswith("model.hf_config: transformers rejects it (llama):") and "num_hidden_layers" in text
    )


def test_real_keys_of_other_architectures_and_legacy_keys_are_accepted(tmp_path):
    gpt2 = tmp_path / "gpt2.yaml"
    gpt2.write_text(
        "model:\n  hf_config:\n    model_type: gpt2\n    n_embd: 64\n    n_layer: 2\n    n_head: 2\n"
    )
    check_user_code(load_config(gpt2, [f"run.dir={tmp_path}/run", "model.hf_config.vocab_size=256"]))
    check_user_code(
        config(tmp_path, "model.hf_config.rope_theta=100000.0", "model.hf_config.hidden_act=gelu")
    )


def pretrained_folder(tmp_path: Path, positions: int) -> Path:
    from transformers import AutoConfig

    folder = tmp_path / "base"
    params = dict(load_config(None).model.hf_config)
    AutoConfig.for_model(
        params.pop("model_type"), **{**params, "max_position_embeddings": positions}
    ).save_pretrained(folder)
    return folder


def test_seq_len_beyond_a_pretrained_models_positions_is_refused(tmp_path):
    folder = pretrained_folder(tmp_path, positions=16)
    text = refusal(config(tmp_path, f"model.pretrained={folder}", "data.seq_len=32"))
    assert text == (
        f"data.seq_len: got 32; expected <= 16, the max_position_embeddings of model.pretrained '{folder}' "
        "(its config.json)"
    )
    check_user_code(config(tmp_path, f"model.pretrained={folder}", "data.seq_len=16"))


def hf_data(tmp_path: Path, tokens: int) -> list[str]:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    (tmp_path / "d.jsonl").write_text('{"text": "a b c"}\n')
    vocab = {"<unk>": 0, **{f"t{i}": i for i in range(1, tokens)}}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, "<unk>"))).save_pretrained(
        tmp_path / "tok"
    )
    return ["data.source=hf", f"data.path={tmp_path / 'd.jsonl'}", f"data.tokenizer={tmp_path / 'tok'}"]


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(tmp_path):
    text = refusal(config(tmp_path, *hf_data(tmp_path, tokens=300)))
    assert text.startswith(
        f"data.tokenizer: '{tmp_path / 'tok'}' has 300 tokens, more than the model's "
        "model.hf_config.vocab_size (256); token ids 256 and up would index past the embedding."
    )


def test_a_tokenizer_within_the_models_vocabulary_is_accepted(tmp_path):
    check_user_code(config(tmp_path, *hf_data(tmp_path, tokens=200)))


def test_a_tokenizer_larger_than_a_factory_models_embedding_is_refused(tmp_path, monkeypatch):
    (tmp_path / "tiny_factory_model.py").write_text(
        "import torch\n\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.embed = torch.nn.Embedding(100, 8)\n\n"
        "    def get_input_embeddings(self):\n"
        "        return self.embed\n\n"
        "def build():\n"
        "    return M()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    text = refusal(config(tmp_path, "model.factory=tiny_factory_model:build", *hf_data(tmp_path, tokens=150)))
    assert text.startswith(
        f"data.tokenizer: '{tmp_path / 'tok'}' has 150 tokens, more than the model's model.factory's input "
        "embedding rows (100)"
    )
