"""`data.source: tokens` and `elastictrain prepare-data`: shards, their index, and the refusals at start."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from elastictrain.cli import app
from elastictrain.config import ConfigError, load_config
from elastictrain.config.model_check import model_problems
from elastictrain.data.token_data import TokenShards
from elastictrain.data.token_index import INDEX, build_index, write_index

WORDS = ["the", "fox", "sees", "a", "lamp", "river", "builds", "map", "near", "bridge"]


def make_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer of 14 tokens, made here (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<pad>", "<eos>", ".", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, "<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )
    fast.save_pretrained(folder)
    return folder


def corpus(tmp_path: Path) -> tuple[list[Path], list[str]]:
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 12)))) + " ." for _ in range(60)]
    jsonl = tmp_path / "in" / "a.jsonl"
    jsonl.parent.mkdir()
    jsonl.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts[:40])))
    txt = tmp_path / "in" / "b.txt"
    txt.write_text("\n".join(texts[40:]) + "\n")
    return [jsonl, txt], texts


def write_shards(folder: Path, parts: list[np.ndarray]) -> None:
    folder.mkdir()
    for k, part in enumerate(parts):
        if part.dtype == np.uint32:
            np.save(folder / f"s{k}.npy", part)
        else:
            part.tofile(folder / f"s{k}.bin")


def test_prepare_data_writes_shards_and_an_index_that_train_reads_as_one_stream(tmp_path):
    inputs, texts = corpus(tmp_path)
    tok = make_tokenizer(tmp_path / "tok")
    out = tmp_path / "shards"
    res = CliRunner().invoke(
        app,
        [
            "prepare-data",
            *map(str, inputs),
            str(out),
            "--tokenizer",
            str(tok),
            "--shard-tokens",
            "100",
            "--workers",
            "2",
        ],
    )
    assert res.exit_code == 0, res.output
    index = json.loads((out / INDEX).read_text())
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tok)
    expected = [
        i for text in texts for i in (*t(text, add_special_tokens=False)["input_ids"], t.eos_token_id)
    ]
    assert index["tokens"] == len(expected) and index["dtype"] == "uint16" and index["vocab_size"] == 14
    assert len(index["shards"]) == -(-len(expected) // 100) >= 3  # several shards of 100 tokens
    assert f"{len(expected)} tokens in {len(index['shards'])} shard(s)" in res.output

    ds = TokenShards(str(out), seq_len=32)
    assert len(ds) == len(expected) // 32
    for i in range(len(ds)):  # samples 3 and 6 span a shard boundary (tokens 96..128, 192..224)
        assert ds[i].tolist() == expected[i * 32 : (i + 1) * 32]
    assert all(isinstance(m, np.memmap) for m in ds._maps.values())  # mapped, never read whole
    cfg = load_config(None, ["data.source=tokens", f"data.path={out}", "data.seq_len=32"])
    assert cfg.data.source == "tokens"


def test_a_sample_spanning_two_shards_of_mixed_files_is_read_right(tmp_path):
    parts = [
        np.arange(0, 10, dtype=np.uint16),
        np.arange(10, 25, dtype=np.uint16),
        np.arange(25, 40, dtype=np.uint16),
    ]
    write_shards(tmp_path / "s", parts)
    ds = TokenShards(str(tmp_path / "s"), seq_len=8)
    assert len(ds) == 5
    assert ds[1].tolist() == list(range(8, 16))  # 8, 9 from the first shard, 10..15 from the second
    assert ds[2].tolist() == list(range(16, 24))
    assert ds[3].tolist() == list(range(24, 32))  # spans the second and third
    assert ds[1].dtype == torch.int64
    big = tmp_path / "big"
    write_shards(big, [np.array([70000, 1, 2], dtype=np.uint32)])
    assert TokenShards(str(big), seq_len=3)[0].tolist() == [70000, 1, 2]  # .npy says its own dtype


@pytest.mark.parametrize("damage", ["truncate", "edit_index", "extra_shard", "missing"])
def test_a_damaged_shard_folder_is_refused_when_the_config_loads_naming_the_file(tmp_path, damage):
    folder = tmp_path / "s"
    write_shards(folder, [np.arange(100, dtype=np.uint16), np.arange(100, dtype=np.uint16)])
    write_index(folder, build_index(folder, "uint16"))
    if damage == "truncate":
        with (folder / "s1.bin").open("r+b") as f:
            f.truncate(120)
        expected = (
            f"data.path: shard {folder / 's1.bin'} is 120 bytes, index.json says 200 bytes (100 tokens)"
        )
    elif damage == "edit_index":
        index = json.loads((folder / INDEX).read_text())
        index["tokens"] = 1000
        (folder / INDEX).write_text(json.dumps(index))
        expected = f"data.path: {folder / INDEX} does not match its checksum (edited or damaged)"
    elif damage == "extra_shard":
        np.arange(5, dtype=np.uint16).tofile(folder / "s2.bin")
        expected = "data.path: shard(s) s2.bin in"
    else:
        (folder / "s0.bin").unlink()
        expected = f"data.path: shard {folder / 's0.bin'} is in index.json but missing"
    with pytest.raises(ConfigError) as e:
        load_config(None, ["data.source=tokens", f"data.path={folder}", "data.seq_len=16"])
    assert expected in str(e.value)


def test_the_first_start_builds_the_index_of_shards_written_elsewhere(tmp_path):
    folder = tmp_path / "s"
    write_shards(folder, [np.arange(64, dtype=np.uint16)])
    load_config(None, ["data.source=tokens", f"data.path={folder}", "data.seq_len=16"])
    index = json.loads((folder / INDEX).read_text())
    assert index["tokens"] == 64 and index["shards"] == [{"name": "s0.bin", "tokens": 64, "bytes": 128}]
    with pytest.raises(ConfigError, match="data.dtype: got uint32; .* says the shards are uint16"):
        load_config(None, ["data.source=tokens", f"data.path={folder}", "data.dtype=uint32"])


def test_shards_of_a_vocabulary_larger_than_the_model_are_refused_before_any_actor_starts(tmp_path):
    inputs, _ = corpus(tmp_path)
    out = tmp_path / "shards"
    CliRunner().invoke(
        app, ["prepare-data", str(inputs[0]), str(out), "--tokenizer", str(make_tokenizer(tmp_path / "tok"))]
    )
    small = ["model.hf_config.vocab_size=12", "data.seq_len=16"]
    cfg = load_config(None, ["data.source=tokens", f"data.path={out}", *small])
    assert model_problems(cfg) == [
        f"data.path: the shards in {str(out)!r} were tokenized with a vocabulary of 14 tokens "
        "(its index.json), more than the model's model.hf_config.vocab_size (12); token ids 12 and up "
        "would index past the embedding. Expected a model with vocab_size >= 14"
    ]
    res = CliRunner().invoke(
        app, ["train", f"run.dir={tmp_path / 'run'}", "data.source=tokens", f"data.path={out}", *small]
    )
    assert res.exit_code == 2 and "vocabulary of 14 tokens" in res.output
    assert not (tmp_path / "run").exists()  # refused before the run folder (and any actor) exists
    assert (
        model_problems(load_config(None, ["data.source=tokens", f"data.path={out}", "data.seq_len=16"])) == []
    )


def test_prepare_data_refuses_a_used_output_folder_and_a_missing_column(tmp_path):
    inputs, _ = corpus(tmp_path)
    tok = str(make_tokenizer(tmp_path / "tok"))
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("x")
    res = CliRunner().invoke(
        app, ["prepare-data", str(inputs[0]), str(tmp_path / "used"), "--tokenizer", tok]
    )
    assert res.exit_code == 2 and "is not an empty folder" in res.output
    res = CliRunner().invoke(
        app, ["prepare-data", str(inputs[0]), str(tmp_path / "o"), "--tokenizer", tok, "--text-field", "body"]
    )
    assert res.exit_code == 2 and "--text-field: got 'body'" in res.output


def test_the_model_check_builds_plainly_after_a_zero3_load_left_transformers_zero3_config_set(
    tmp_path, monkeypatch
):
    """A `--local` ZeRO-3 run's worker loading a pretrained model sets transformers' process-wide ZeRO-3
    config; a config checked afterwards in the same process must still build (on meta, no zero.Init)."""
    monkeypatch.setenv("ELASTICTRAIN_CACHE", str(tmp_path))  # built here, not read from an earlier build
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    held = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    assert is_deepspeed_zero3_enabled()
    assert model_problems(load_config(None, [])) == []
    del held
