"""Preference data (issue 58): pairs and KTO examples from LLaMA-Factory's and TRL's record shapes, encoded
through a chat template (prompt once, answers as its continuation), cut to seq_len as LLaMA-Factory does."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from elastictrain.config import load_config
from elastictrain.data.preference.build import PreferenceDataError, build_kto, build_pairs
from elastictrain.data.preference.encode import EncodedPair, cut, encode_pair, infer_seqlen
from elastictrain.data.preference.records import (
    PreferencePair,
    detect_pairs,
    pair_layout,
    to_kto,
    to_pair,
)
from elastictrain.data.sft.records import Layout, RecordProblem, make_layout
from elastictrain.data.sft.render import TemplateProblem

TINY = Path(__file__).resolve().parents[2] / "conf" / "tiny-cpu.yaml"

USER = {"role": "user", "content": "name a colour"}


def _pair(record: dict[str, Any], formatting: str | None = None, **kw: Any) -> Any:
    fmt = formatting or detect_pairs(record)
    assert fmt is not None
    return to_pair(record, pair_layout(fmt, kw.get("columns"), kw.get("tags")), kw.get("system"))


def test_alpaca_ranking_joins_instruction_and_input_and_keeps_history_and_system():
    record = {
        "instruction": "name a colour",
        "input": "of the sky",
        "chosen": "blue",
        "rejected": "green",
        "system": "be brief",
        "history": [["hi", "hello"]],
    }
    pair = _pair(record)
    assert pair.prompt == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "name a colour\nof the sky"},
    ]
    assert pair.chosen == {"role": "assistant", "content": "blue"}
    assert pair.rejected == {"role": "assistant", "content": "green"}


def test_alpaca_ranking_reads_renamed_columns():
    cols = {"prompt": "q", "query": "ctx", "chosen": "good", "rejected": "bad"}
    pair = _pair({"q": "name a colour", "good": "blue", "bad": "green"}, "alpaca", columns=cols)
    assert pair.prompt == [USER] and pair.chosen["content"] == "blue" and pair.rejected["content"] == "green"


def test_sharegpt_ranking_takes_conversations_as_prompt_and_single_turn_answers():
    record = {
        "conversations": [
            {"from": "human", "value": "hi"},
            {"from": "gpt", "value": "hello"},
            {"from": "human", "value": "name a colour"},
        ],
        "chosen": {"from": "gpt", "value": "blue"},
        "rejected": {"from": "gpt", "value": "green"},
    }
    pair = _pair(record)
    assert [m["role"] for m in pair.prompt] == ["user", "assistant", "user"]
    assert pair.prompt[-1] == USER
    assert (pair.chosen["content"], pair.rejected["content"]) == ("blue", "green")


def test_sharegpt_ranking_with_a_system_turn_and_a_tool_call_answer():
    call = json.dumps({"name": "paint", "arguments": {"colour": "blue"}})
    record = {
        "conversations": [
            {"from": "system", "value": "be brief"},
            {"from": "human", "value": "name a colour"},
        ],
        "chosen": {"from": "function_call", "value": call},
        "rejected": {"from": "gpt", "value": "green"},
    }
    pair = _pair(record)
    assert pair.prompt == [{"role": "system", "content": "be brief"}, USER]
    assert pair.chosen["tool_calls"][0]["function"] == {"name": "paint", "arguments": {"colour": "blue"}}


def test_openai_ranking_reads_role_content_answers():
    record = {"messages": [USER], "chosen": _a("blue"), "rejected": _a("green")}
    pair = to_pair(record, pair_layout("openai", None, None))
    assert pair.prompt == [USER] and pair.rejected == _a("green")


def test_sharegpt_ranking_renamed_tags():
    tags = {"role_tag": "s", "content_tag": "t", "user_tag": "p", "assistant_tag": "b"}
    cols = {"messages": "dialog", "chosen": "chosen", "rejected": "rejected"}
    record = {"dialog": [{"s": "p", "t": "name a colour"}], "chosen": {"s": "b", "t": "blue"}}
    record["rejected"] = {"s": "b", "t": "green"}
    pair = _pair(record, "sharegpt", columns=cols, tags=tags)
    assert pair.prompt == [USER] and pair.rejected == {"role": "assistant", "content": "green"}


def test_trl_explicit_prompt_strings_and_default_system():
    pair = _pair({"prompt": "name a colour", "chosen": "blue", "rejected": "green"}, system="be brief")
    assert pair.prompt == [{"role": "system", "content": "be brief"}, USER]
    assert (pair.chosen["content"], pair.rejected["content"]) == ("blue", "green")


def test_trl_message_lists():
    record = {
        "prompt": [USER],
        "chosen": [{"role": "assistant", "content": "blue"}],
        "rejected": [{"role": "assistant", "content": "green"}],
    }
    pair = _pair(record)
    assert pair.prompt == [USER] and pair.chosen == {"role": "assistant", "content": "blue"}


def test_trl_implicit_prompt_is_the_common_prefix():
    head = [{"role": "system", "content": "be brief"}, USER]
    record = {
        "chosen": [*head, {"role": "assistant", "content": "blue"}],
        "rejected": [*head, {"role": "assistant", "content": "green"}],
    }
    pair = _pair(record)
    assert pair.prompt == head
    assert (pair.chosen["content"], pair.rejected["content"]) == ("blue", "green")


def test_trl_text_that_looks_like_json_stays_text_and_csv_message_lists_are_read():
    pair = _pair({"prompt": "name two numbers", "chosen": "[1, 2]", "rejected": "[]"})
    assert (pair.chosen["content"], pair.rejected["content"]) == ("[1, 2]", "[]")
    cell = json.dumps([{"role": "assistant", "content": "blue"}])
    pair = _pair({"prompt": json.dumps([USER]), "chosen": cell, "rejected": "green"}, "trl")
    assert pair.prompt == [USER] and pair.chosen["content"] == "blue"


def test_kto_tag_on_an_sft_record():
    cols = {"prompt": "instruction", "response": "output", "kto_tag": "kto_tag"}
    layout = make_layout("alpaca", cols, None)
    ex = to_kto({"instruction": "name a colour", "output": "blue", "kto_tag": False}, layout)
    assert ex.prompt == [USER] and ex.answer["content"] == "blue" and ex.desirable is False


def test_kto_trl_unpaired_prompt_completion_label():
    ex = to_kto({"prompt": "name a colour", "completion": "blue", "label": True}, Layout("trl", {}))
    assert ex.prompt == [USER] and ex.answer == {"role": "assistant", "content": "blue"} and ex.desirable


@pytest.mark.parametrize(
    ("record", "formatting", "field", "words"),
    [
        (
            {"instruction": "q", "chosen": "", "rejected": "x"},
            "alpaca",
            "chosen",
            "empty; expected the preferred",
        ),
        ({"instruction": "q", "chosen": "x"}, "alpaca", "rejected", "missing; expected the dispreferred"),
        ({"chosen": "x", "rejected": "y", "system": "s"}, "alpaca", "instruction", "missing"),
        (
            {
                "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}],
                "chosen": {"from": "gpt", "value": "x"},
                "rejected": {"from": "gpt", "value": "y"},
            },
            "sharegpt",
            "conversations[1].from",
            "end with a 'human'",
        ),
        (
            {
                "conversations": [{"from": "human", "value": "q"}],
                "chosen": {"from": "human", "value": "x"},
                "rejected": {"from": "gpt", "value": "y"},
            },
            "sharegpt",
            "chosen.from",
            "expected 'gpt'",
        ),
        ({"prompt": "q", "chosen": "x", "rejected": 3}, "trl", "rejected", "got a number"),
        ({"chosen": "a", "rejected": "b"}, "trl", "chosen", "no prompt column"),
        (
            {
                "chosen": [USER, {"role": "assistant", "content": "a"}],
                "rejected": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "b"}],
            },
            "trl",
            "chosen[0]",
            "share every message",
        ),
    ],
)
def test_bad_records_name_their_field(record: dict[str, Any], formatting: str, field: str, words: str):
    with pytest.raises(RecordProblem) as e:
        _pair(record, formatting)
    assert e.value.field == field and words in e.value.reason, str(e.value)


def test_kto_tag_that_is_not_a_bool_is_named():
    layout = make_layout("alpaca", {"prompt": "instruction", "response": "output", "kto_tag": "tag"}, None)
    with pytest.raises(RecordProblem, match="^tag: got a number; expected true"):
        to_kto({"instruction": "q", "output": "a", "tag": 1}, layout)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sft_fixtures import make_chatml_tokenizer

    return make_chatml_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def hf(tok: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok)


def data_config(tmp_path: Path, tok: Path, **fields: Any) -> Any:
    """A DataConfig of data.source sft (the loader refuses ranking entries there), then the fields."""
    sft_file = tmp_path / "sft.jsonl"
    sft_file.write_text(json.dumps({"instruction": "q", "output": "a"}) + "\n")
    config = load_config(TINY, ["data.source=sft", f"data.tokenizer={tok}", f"data.path={sft_file}"])
    return dataclasses.replace(config.data, **{"seq_len": 128, **fields})


def _decode(hf: Any, ids: list[int]) -> str:
    return str(hf.decode(ids, skip_special_tokens=False))


def test_the_prompt_is_rendered_once_and_each_answer_is_its_continuation(hf):
    pair = PreferencePair([{"role": "system", "content": "be brief"}, USER], _a("blue"), _a("green"))
    enc = encode_pair(hf, pair, "r", "tok")
    rendered = hf.apply_chat_template(pair.prompt, add_generation_prompt=True, tokenize=False)
    assert _decode(hf, enc.prompt_ids) == rendered
    assert _decode(hf, enc.chosen_ids) == "blue<|im_end|>\n"
    assert _decode(hf, enc.rejected_ids) == "green<|im_end|>\n"
    whole = hf.apply_chat_template([*pair.prompt, _a("blue")], tokenize=False)
    assert _decode(hf, enc.prompt_ids + enc.chosen_ids) == whole


def test_a_template_whose_prompt_is_no_prefix_of_the_answer_is_refused(tok):
    from transformers import AutoTokenizer

    broken = AutoTokenizer.from_pretrained(tok)
    # The generation prompt writes a marker the finished conversation does not.
    broken.chat_template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant says: ' }}{% endif %}"
    )
    with pytest.raises(TemplateProblem, match="cannot place the chosen answer of r: the prompt's tokens"):
        encode_pair(broken, PreferencePair([USER], _a("blue"), _a("green")), "r", "tpl")


def test_the_cut_splits_seq_len_as_llama_factory_and_keeps_answer_tokens():
    pair = EncodedPair(list(range(100)), list(range(1000, 1030)), list(range(2000, 2010)))
    kept = cut(pair, 64)
    assert kept is not None
    source, target = infer_seqlen(100, 30, 64)
    assert (len(kept.prompt_ids), len(kept.chosen_ids), len(kept.rejected_ids)) == (source, target, 10)
    assert len(kept.prompt_ids) + len(kept.chosen_ids) <= 64
    assert kept.prompt_ids == list(range(source))  # LLaMA-Factory keeps the prompt's start
    assert kept.chosen_ids == list(range(1000, 1000 + target))
    assert cut(EncodedPair([1, 2], [3], [4]), 8) == EncodedPair([1, 2], [3], [4])  # fits: unchanged


def test_a_pair_whose_answer_keeps_no_token_is_dropped():
    # infer_seqlen gives the answers int(10 * 5 / 205) = 0 tokens.
    assert cut(EncodedPair(list(range(200)), [1] * 5, [2] * 3), 10) is None


def _a(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def write_ranking_folder(folder: Path) -> Path:
    """A LLaMA-Factory data folder like its dpo_en_demo (sharegpt) and an alpaca ranking one."""
    folder.mkdir(parents=True, exist_ok=True)
    sharegpt = [
        {
            "conversations": [{"from": "human", "value": f"name colour {i}"}],
            "chosen": {"from": "gpt", "value": f"blue {i}"},
            "rejected": {"from": "gpt", "value": f"green {i}"},
        }
        for i in range(4)
    ]
    long_prompt = {
        "conversations": [{"from": "human", "value": "the fox sees a bright lamp " * 40}],
        "chosen": {"from": "gpt", "value": "ok"},
        "rejected": {"from": "gpt", "value": "no"},
    }
    (folder / "dpo_demo.json").write_text(json.dumps([*sharegpt, long_prompt]))
    alpaca = [{"question": f"name colour {i}", "good": "blue", "bad": "green"} for i in range(3)]
    alpaca.append({"question": "name a colour", "good": "", "bad": "green"})
    (folder / "ranked.jsonl").write_text("".join(json.dumps(r) + "\n" for r in alpaca))
    info = {
        "dpo_demo": {
            "file_name": "dpo_demo.json",
            "ranking": True,
            "formatting": "sharegpt",
            "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"},
        },
        "ranked": {
            "file_name": "ranked.jsonl",
            "ranking": True,
            "columns": {"prompt": "question", "chosen": "good", "rejected": "bad"},
        },
        "plain": {"file_name": "dpo_demo.json"},
    }
    (folder / "dataset_info.json").write_text(json.dumps(info))
    return folder


def test_a_dataset_info_folder_with_ranking_entries_builds_in_order(tmp_path, tok, hf):
    folder = write_ranking_folder(tmp_path / "lf")
    data = data_config(tmp_path, tok, path=None, dataset_dir=str(folder), dataset="dpo_demo")
    pairs, report = build_pairs(data)
    assert report.records == 5 and len(pairs) == 5 and report.bad == []
    assert _decode(hf, pairs[2].chosen_ids) == "blue 2<|im_end|>\n"
    assert "name colour 2" in _decode(hf, pairs[2].prompt_ids)
    assert report.origins[0] == (str(folder / "dpo_demo.json"), 0)
    assert len(pairs[4].prompt_ids) + len(pairs[4].chosen_ids) <= 128  # its prompt cut, answers whole
    assert _decode(hf, pairs[4].rejected_ids) == "no<|im_end|>\n"
    # At seq_len 8 the long prompt leaves its answers no token: dropped and counted.
    short = dataclasses.replace(data, seq_len=8, dataset="dpo_demo")
    kept, report = build_pairs(short)
    assert [i for _, i, _ in report.dropped] == [4] and len(kept) == 4
    assert all(len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids)) <= 8 for p in kept)


def test_bad_records_of_an_entry_are_named_with_file_index_and_field_then_skipped(tmp_path, tok):
    folder = write_ranking_folder(tmp_path / "lf")
    data = data_config(tmp_path, tok, path=None, dataset_dir=str(folder), dataset="ranked,dpo_demo")
    with pytest.raises(PreferenceDataError, match=r"ranked.jsonl record 3: good: empty; expected the pre"):
        build_pairs(data)
    pairs, report = build_pairs(dataclasses.replace(data, on_bad_record="skip"))
    assert len(pairs) == 3 + 5 and len(report.bad) == 1


def test_an_entry_without_ranking_is_refused_for_pairs(tmp_path, tok):
    folder = write_ranking_folder(tmp_path / "lf")
    data = data_config(tmp_path, tok, path=None, dataset_dir=str(folder), dataset="plain")
    with pytest.raises(PreferenceDataError, match="'plain'.*not preference data; expected ranking: true"):
        build_pairs(data)


def test_trl_files_via_data_path_build_pairs_and_kto_examples(tmp_path, tok, hf):
    head = [USER]
    rows = [
        {"prompt": "name a colour", "chosen": "blue", "rejected": "green"},
        {"chosen": [*head, _a("blue")], "rejected": [*head, _a("red")]},
    ]
    path = tmp_path / "trl.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs, _ = build_pairs(data_config(tmp_path, tok, path=str(path)))
    assert [_decode(hf, p.rejected_ids) for p in pairs] == ["green<|im_end|>\n", "red<|im_end|>\n"]
    assert pairs[0].prompt_ids == pairs[1].prompt_ids
    kto = tmp_path / "kto.jsonl"
    kto.write_text(json.dumps({"prompt": "name a colour", "completion": "blue", "label": False}) + "\n")
    examples, _ = build_kto(data_config(tmp_path, tok, path=str(kto)))
    assert examples[0].desirable is False and _decode(hf, examples[0].answer_ids) == "blue<|im_end|>\n"


def test_a_kto_tag_entry_builds_kto_examples_and_is_refused_for_pairs(tmp_path, tok, hf):
    folder = tmp_path / "lf"
    folder.mkdir()
    rows = [
        {
            "conversations": [{"from": "human", "value": "name a colour"}, {"from": "gpt", "value": c}],
            "tag": t,
        }
        for c, t in (("blue", True), ("green", False))
    ]
    (folder / "kto.json").write_text(json.dumps(rows))
    columns = {"messages": "conversations", "kto_tag": "tag"}
    entry = {"file_name": "kto.json", "formatting": "sharegpt", "columns": columns}
    (folder / "dataset_info.json").write_text(json.dumps({"kto": entry}))
    data = data_config(tmp_path, tok, path=None, dataset_dir=str(folder), dataset="kto")
    examples, report = build_kto(data)
    assert [e.desirable for e in examples] == [True, False] and report.records == 2
    assert _decode(hf, examples[1].answer_ids) == "green<|im_end|>\n"
    with pytest.raises(PreferenceDataError, match="'kto' hold KTO examples"):
        build_pairs(data)


def test_entries_that_download_or_miss_columns_are_refused_with_their_reasons(tmp_path, tok):
    folder = write_ranking_folder(tmp_path / "lf")
    info = json.loads((folder / "dataset_info.json").read_text())
    info["hub"] = {"hf_hub_url": "someone/pairs", "ranking": True}
    info["half"] = {"file_name": "ranked.jsonl", "ranking": True, "columns": {"prompt": "question"}}
    info["odd"] = {"file_name": "ranked.jsonl", "ranking": True, "columns": {"answer": "x"}}
    (folder / "dataset_info.json").write_text(json.dumps(info))
    data = data_config(tmp_path, tok, path=None, dataset_dir=str(folder), dataset="hub,odd,nope")
    with pytest.raises(PreferenceDataError) as e:
        build_pairs(data)
    text = str(e.value)
    assert "hf_hub_url 'someone/pairs' is a Hugging Face Hub dataset" in text
    assert "columns.answer: unknown" in text and "'nope' is not in" in text
    half = dataclasses.replace(data, dataset="half")
    with pytest.raises(PreferenceDataError, match=r"columns.chosen: missing; a columns mapping names every"):
        build_pairs(half)
