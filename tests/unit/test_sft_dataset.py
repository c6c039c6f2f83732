"""`data.source: sft` with a real tokenizer and real files: token ids as the chat template renders them,
labels on the answers only, the cut at data.seq_len, bad records, dataset_info.json folders."""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from sft_fixtures import CHATML, messages_of, write_dataset_info, write_records

from elastictrain.config import ConfigError, load_config
from elastictrain.data.sft.dataset import SftDataError, build_sft_dataset
from elastictrain.data.sources import dataset_from_config

TINY = Path(__file__).resolve().parents[2] / "conf" / "tiny-cpu.yaml"
END = "<|im_end|>\n"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sft_fixtures import make_chatml_tokenizer

    return make_chatml_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def hf(tok: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok)


def sft(tok: Path, *overrides: str) -> Any:
    return load_config(
        TINY,
        ["data.source=sft", f"data.tokenizer={tok}", "data.packing=false", "data.seq_len=128", *overrides],
    )


def read(path: Path) -> list[dict[str, Any]]:
    text = path.read_text()
    return json.loads(text) if path.suffix == ".json" else [json.loads(line) for line in text.splitlines()]


def runs(hf: Any, item: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(trained texts, untrained texts): each run of labelled / unlabelled tokens, decoded."""
    ids, labels = item["input_ids"].tolist(), item["labels"].tolist()
    assert all(lab in (-100, t) for t, lab in zip(ids, labels, strict=True))
    trained: list[str] = []
    other: list[str] = []
    start = 0
    while start < len(ids):
        on = labels[start] != -100
        end = start
        while end < len(ids) and (labels[end] != -100) == on:
            end += 1
        (trained if on else other).append(hf.decode(ids[start:end]))
        start = end
    return trained, other


@pytest.mark.parametrize("formatting", ["alpaca", "sharegpt", "openai"])
def test_each_formatting_renders_as_apply_chat_template_with_labels_on_the_answers_only(
    tmp_path, tok, hf, formatting
):
    path = write_records(tmp_path, formatting, 24)
    dataset = dataset_from_config(sft(tok, f"data.path={path}"))  # formatting detected
    records = read(path)
    assert len(dataset) == len(records)
    for i in range(len(dataset)):
        messages = messages_of(records[i], formatting)
        item = dataset[i]
        assert item["input_ids"].tolist() == hf.apply_chat_template(messages)["input_ids"]
        trained, prompts = runs(hf, item)
        assert trained == [m["content"] + END for m in messages if m["role"] == "assistant"]
        assert all(p.endswith("<|im_start|>assistant\n") for p in prompts)


def test_mask_history_train_on_prompt_and_a_default_system(tmp_path, tok, hf):
    path = write_records(tmp_path, "sharegpt", 12)
    records = read(path)
    multi = next(i for i, r in enumerate(records) if len(r["conversations"]) > 3)
    last = dataset_from_config(sft(tok, f"data.path={path}", "data.mask_history=true"))
    answers = [m["value"] for m in records[multi]["conversations"] if m["from"] == "gpt"]
    assert runs(hf, last[multi])[0] == [answers[-1] + END]
    everything = dataset_from_config(sft(tok, f"data.path={path}", "data.train_on_prompt=true"))
    assert everything[multi]["labels"].tolist() == everything[multi]["input_ids"].tolist()
    system = dataset_from_config(sft(tok, f"data.path={path}", "data.system=be kind"))
    for i, record in enumerate(records):
        text = hf.decode(system[i]["input_ids"])
        has_own = record["conversations"][0]["from"] == "system"
        assert text.startswith("<|im_start|>system\n") and ("be kind" in text) != has_own


def test_a_long_record_loses_its_end_and_one_with_no_answer_left_is_dropped_and_counted(
    tmp_path, tok, hf, caplog
):
    records = [
        {"instruction": "the fox", "input": "", "output": " ".join(["stars"] * 80)},  # the answer is cut
        {"instruction": " ".join(["north"] * 80), "input": "", "output": "lamp"},  # the prompt fills seq_len
        {"instruction": "a robot", "input": "", "output": "the bridge"},
    ]
    path = tmp_path / "long.json"
    path.write_text(json.dumps(records))
    with caplog.at_level(logging.WARNING, "elastictrain.data"):
        dataset = dataset_from_config(sft(tok, f"data.path={path}", "data.seq_len=32"))
    assert len(dataset) == 2 and dataset.origins == [(str(path), 0), (str(path), 2)]
    full = hf.apply_chat_template(messages_of(records[0], "alpaca"))["input_ids"]
    assert len(full) > 32 and dataset[0]["input_ids"].tolist() == full[:32]
    assert all(int((dataset[i]["labels"][1:] != -100).sum()) > 0 for i in range(len(dataset)))
    assert (
        f"1 record(s) dropped: no answer token fits in data.seq_len=32 after the prompt ({path} record 1: "
        "a prompt of" in caplog.text
    )
    with pytest.raises(SftDataError, match="no trainable record"):
        dataset_from_config(sft(tok, f"data.path={path}", "data.seq_len=4"))


def test_csv_and_parquet_hold_the_same_records_as_json(tmp_path, tok):
    import datasets

    path = write_records(tmp_path, "alpaca", 12)
    records = read(path)
    rows = [
        {**r, "history": json.dumps(r.get("history", [])), "system": r.get("system", "")} for r in records
    ]
    with (tmp_path / "a.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, ["instruction", "input", "output", "history", "system"])
        writer.writeheader()
        writer.writerows(rows)
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "a.parquet"))
    want = dataset_from_config(sft(tok, f"data.path={path}"))
    for name in ("a.csv", "a.parquet"):
        got = dataset_from_config(sft(tok, f"data.path={tmp_path / name}"))
        assert [got[i]["input_ids"].tolist() for i in range(len(got))] == [
            want[i]["input_ids"].tolist() for i in range(len(want))
        ], name


def test_templates_a_file_none_and_one_that_breaks_the_prefix_property(tmp_path, tok):
    from transformers import AutoTokenizer

    bare = tmp_path / "bare"
    plain = AutoTokenizer.from_pretrained(tok)
    plain.chat_template = None
    plain.save_pretrained(bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    path = write_records(tmp_path, "openai", 8)
    with pytest.raises(
        SftDataError, match=r"data.tokenizer: .* has no chat template; give data.template=FILE"
    ):
        build_sft_dataset(sft(bare, f"data.path={path}").data)
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    assert len(build_sft_dataset(sft(bare, f"data.path={path}", f"data.template={template}").data)) == 8
    broken = tmp_path / "broken.jinja"  # the last answer of a conversation is rendered differently
    broken.write_text(CHATML.replace("'<|im_end|>'", "('<|im_end|>' if not loop.last else '<|endoftext|>')"))
    with pytest.raises(SftDataError, match=r"is not a prefix of the whole conversation's tokens") as e:
        build_sft_dataset(sft(tok, f"data.path={path}", f"data.template={broken}").data)
    assert f"{path} record 0: at message 1 (an answer), its prompt (add_generation_prompt=True)" in str(
        e.value
    )


def test_bad_records_are_named_and_refused_then_skipped_and_counted(tmp_path, tok, caplog):
    good = read(write_records(tmp_path, "sharegpt", 6))
    bad = [
        {"conversations": []},
        {"conversations": [{"from": "gpt", "value": "a"}, {"from": "human", "value": "b"}]},
        {"conversations": [{"from": "human", "value": "only a question"}]},
        {"chat": "wrong column"},
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [*good[:3], *bad, *good[3:]]) + "{not json\n")
    with pytest.raises(SftDataError) as e:
        build_sft_dataset(sft(tok, f"data.path={path}").data)
    message = str(e.value)
    assert message.startswith("data: 5 of 11 instruction records are bad:")
    for line in (
        f"{path} record 3: conversations: an empty conversation",
        f"{path} record 4: conversations[0].from: got 'gpt'",
        f"{path} record 5: conversations: ends with a 'human' turn",
        f"{path} record 6: conversations: missing",
        f"{path} record 10: line 11: not valid JSON",
    ):
        assert line in message
    assert "data.on_bad_record=skip" in message
    with caplog.at_level(logging.WARNING, "elastictrain.data"):
        dataset = build_sft_dataset(sft(tok, f"data.path={path}", "data.on_bad_record=skip").data)
    assert len(dataset) == 6 and "skipped 5 bad record(s) of 11" in caplog.text


def test_a_dataset_info_folder_trains_on_the_named_datasets_in_order_capped_by_max_samples(tmp_path, tok, hf):
    folder = write_dataset_info(tmp_path / "data")
    both = dataset_from_config(sft(tok, f"data.dataset_dir={folder}", "data.dataset=chats,qa"))
    assert len(both) == 18
    assert [Path(f).name for f, _ in both.origins] == ["part-0.jsonl"] * 8 + ["qa.json"] * 10
    capped = dataset_from_config(
        sft(tok, f"data.dataset_dir={folder}", "data.dataset=qa,chats", "data.max_samples=3")
    )
    assert [(Path(f).name, i) for f, i in capped.origins] == [("qa.json", i) for i in range(3)] + [
        ("part-0.jsonl", i) for i in range(3)
    ]
    first = json.loads((folder / "qa.json").read_text())[0]
    user = "\n".join(x for x in (first["question"], first["context"]) if x)
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": first["answer"]}]
    assert capped[0]["input_ids"].tolist() == hf.apply_chat_template(messages)["input_ids"]


def test_hub_ranking_and_unknown_entries_are_refused_with_their_reasons(tmp_path, tok):
    folder = write_dataset_info(
        tmp_path / "data",
        {
            "hub": {"hf_hub_url": "someone/alpaca"},
            "pairs": {"file_name": "qa.json", "ranking": True},
            "scope": {"ms_hub_url": "x/y", "om_hub_url": "x/z"},
        },
    )
    with pytest.raises(ConfigError) as e:
        sft(tok, f"data.dataset_dir={folder}", "data.dataset=qa,hub,pairs,scope,nope")
    message = str(e.value)
    info = folder / "dataset_info.json"
    assert (
        f"data.dataset: 'hub' ({info}): hf_hub_url 'someone/alpaca' is a Hugging Face Hub dataset" in message
    )
    assert "reads local files only" in message
    assert f"data.dataset: 'pairs' ({info}): ranking: true is a preference dataset" in message
    assert "ms_hub_url 'x/y' is a ModelScope dataset" in message and "om_hub_url 'x/z'" in message
    assert f"data.dataset: 'nope' is not in {info}" in message
    assert "'qa'" not in message
    with pytest.raises(ConfigError, match="data.on_bad_record: got 'drop'; expected error"):
        sft(tok, f"data.dataset_dir={folder}", "data.dataset=qa", "data.on_bad_record=drop")
    with pytest.raises(ConfigError, match="data.tokenizer: missing; expected a local tokenizer folder") as e:
        load_config(
            TINY, ["data.source=sft", f"data.dataset_dir={folder}", "data.dataset=qa", "data.max_samples=0"]
        )
    assert "data.max_samples: got 0; expected >= 1" in str(e.value)
    with pytest.raises(ConfigError, match="data.path: got .* and data.dataset 'qa'; expected one of them"):
        sft(tok, f"data.dataset_dir={folder}", "data.dataset=qa", f"data.path={folder / 'qa.json'}")


def test_unrecognised_records_ask_for_data_formatting(tmp_path, tok):
    path = tmp_path / "plain.jsonl"
    path.write_text('{"text": "hello"}\n')
    with pytest.raises(
        SftDataError, match=r"data.formatting: not set, and the records of .* \(columns: text\)"
    ):
        build_sft_dataset(sft(tok, f"data.path={path}").data)


def test_an_hf_source_on_instruction_records_points_at_data_source_sft(tmp_path, tok):
    from elastictrain.data.hf_files import check_hf_data

    path = write_records(tmp_path, "alpaca", 2)
    cfg = load_config(TINY, ["data.source=hf", f"data.path={path}", f"data.tokenizer={tok}"])
    with pytest.raises(
        ValueError, match="columns of .* are instruction, .*; instruction records train with data.source=sft"
    ):
        check_hf_data(cfg.data)
