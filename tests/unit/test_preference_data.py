"""Preference data (issue 58): pairs and KTO examples from LLaMA-Factory's and TRL's record shapes, encoded
through a chat template (prompt once, answers as its continuation), cut to seq_len as LLaMA-Factory does."""

from __future__ import annotations

from typing import Any

import pytest

from elastictrain.data.preference.records import (
    detect_pairs,
    pair_layout,
    to_kto,
    to_pair,
)
from elastictrain.data.sft.records import Layout, RecordProblem, make_layout

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
