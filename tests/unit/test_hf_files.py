"""`data.source: hf` on local files: a glob in data.path reads every file it matches, in name order."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from elastictrain.data.hf_files import build_hf_dataset, data_files


def word_tokenizer(folder: Path, words: list[str]) -> None:
    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, "<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    fast.save_pretrained(folder)


def test_a_glob_reads_every_matching_file_in_name_order(tmp_path):
    # Written out of order: the files are read sorted by name, whatever the directory's order.
    (tmp_path / "b.jsonl").write_text('{"text": "three four"}\n')
    (tmp_path / "a.jsonl").write_text('{"text": "one two"}\n{"text": "five"}\n')
    (tmp_path / "notes.txt").write_text("not data\n")  # not matched by *.jsonl
    word_tokenizer(tmp_path / "tok", ["one", "two", "three", "four", "five"])
    data = OmegaConf.create(
        {
            "path": str(tmp_path / "*.jsonl"),
            "format": None,
            "text_field": "text",
            "tokenizer": str(tmp_path / "tok"),
            "packing": True,
            "seq_len": 3,
        }
    )

    files, fmt = data_files(data)
    assert (files, fmt) == ([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], "json")
    # one two <eos> | five <eos> three | four <eos>: packed across records and files; a last block
    # shorter than seq_len is dropped.
    blocks = build_hf_dataset(data)[:]["input_ids"].tolist()
    assert blocks == [[2, 3, 1], [6, 1, 4]]
