"""Instruction records to message lists (data/sft/records.py) and the label rules (core/sft_labels.py):
pure, no tokenizer."""

from __future__ import annotations

import json

import pytest

from elastictrain.core.sft_labels import IGNORE_INDEX, PrefixBroken, answer_spans, kept_length, labels_for
from elastictrain.data.sft.records import RecordProblem, convert, detect, layout_problems, make_layout

ALPACA = make_layout("alpaca", None, None)
SHAREGPT = make_layout("sharegpt", None, None)
OPENAI = make_layout("openai", None, None)


def test_alpaca_joins_instruction_and_input_and_puts_history_and_system_first():
    record = {
        "instruction": "Translate",
        "input": "bonjour",
        "output": "hello",
        "system": "be brief",
        "history": [["hi", "hey"], ["how are you", "fine"]],
    }
    assert convert(record, ALPACA).messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hey"},
        {"role": "user", "content": "how are you"},
        {"role": "assistant", "content": "fine"},
        {"role": "user", "content": "Translate\nbonjour"},
        {"role": "assistant", "content": "hello"},
    ]
    # An empty input adds nothing; data.system stands in where the record has no system; CSV's JSON text.
    plain = convert({"instruction": "Say hi", "input": "", "output": "hi", "history": "[]"}, ALPACA, "sys")
    assert plain.messages == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": "hi"},
    ]


def test_sharegpt_maps_roles_and_keeps_tool_calls_as_transformers_templates_read_them():
    record = {
        "conversations": [
            {"from": "system", "value": "tools on"},
            {"from": "human", "value": "weather?"},
            {
                "from": "function_call",
                "value": json.dumps({"name": "weather", "arguments": {"city": "Oslo"}}),
            },
            {"from": "observation", "value": "rain"},
            {"from": "gpt", "value": "It rains."},
        ],
        "tools": json.dumps([{"name": "weather", "parameters": {}}]),
    }
    conversation = convert(record, SHAREGPT)
    assert [m["role"] for m in conversation.messages] == ["system", "user", "assistant", "tool", "assistant"]
    call = conversation.messages[2]
    assert call["tool_calls"] == [
        {"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}
    ]
    assert conversation.tools == [{"name": "weather", "parameters": {}}]


def test_openai_messages_with_tool_calls_and_several_tool_results():
    record = {
        "messages": [
            {"role": "user", "content": "two lookups"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"type": "function", "function": {"name": "a"}}],
            },
            {"role": "tool", "content": "1", "tool_call_id": "x"},
            {"role": "tool", "content": "2", "tool_call_id": "y"},
            {"role": "assistant", "content": "done"},
        ]
    }
    messages = convert(record, OPENAI).messages
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool", "assistant"]
    assert messages[1]["content"] == "" and messages[2]["tool_call_id"] == "x"


def test_renamed_columns_and_tags_as_dataset_info_spells_them():
    layout = make_layout(
        "sharegpt",
        {"messages": "dialog", "system": "sys"},
        {"role_tag": "who", "content_tag": "text", "user_tag": "person", "assistant_tag": "bot"},
    )
    record = {"sys": "S", "dialog": [{"who": "person", "text": "q"}, {"who": "bot", "text": "a"}]}
    assert convert(record, layout).messages == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ]
    assert layout_problems(make_layout("sharegpt", {"messages": "m"}, {"role_tag": "r"}), "data")[
        0
    ].startswith("data.tags.content_tag: missing")
    # A columns mapping names every column read: "input" is not read unless named.
    only = make_layout("alpaca", {"prompt": "q", "response": "a"}, None)
    assert convert({"q": "Q", "input": "ignored", "a": "A"}, only).messages[0] == {
        "role": "user",
        "content": "Q",
    }


def test_the_formatting_is_detected_from_a_record():
    assert detect({"instruction": "x", "output": "y"}, None, None) == "alpaca"
    assert detect({"conversations": [{"from": "human", "value": "x"}]}, None, None) == "sharegpt"
    assert detect({"messages": [{"role": "user", "content": "x"}]}, None, None) == "openai"
    assert detect({"dialog": [{"who": "a"}]}, {"messages": "dialog"}, {"role_tag": "who"}) == "sharegpt"
    assert detect({"q": "x", "a": "y"}, {"prompt": "q", "response": "a"}, None) == "alpaca"
    assert detect({"text": "plain"}, None, None) is None


@pytest.mark.parametrize(
    ("layout", "record", "field", "words"),
    [
        (ALPACA, {"instruction": "x"}, "output", "missing"),
        (ALPACA, {"instruction": "x", "output": "  "}, "output", "empty"),
        (ALPACA, {"output": "y"}, "instruction", "missing"),
        (ALPACA, {"instruction": "x", "output": "y", "history": [["only one"]]}, "history[0]", "pair"),
        (SHAREGPT, {"conversations": []}, "conversations", "empty conversation"),
        (SHAREGPT, {"other": 1}, "conversations", "missing"),
        (
            SHAREGPT,
            {"conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"}]},
            "conversations[1].from",
            "out of order",
        ),
        (
            SHAREGPT,
            {"conversations": [{"from": "gpt", "value": "a"}]},
            "conversations[0].from",
            "out of order",
        ),
        (SHAREGPT, {"conversations": [{"from": "human", "value": "a"}]}, "conversations", "last turn"),
        (
            SHAREGPT,
            {"conversations": [{"from": "bot", "value": "a"}]},
            "conversations[0].from",
            "expected one of",
        ),
        (
            OPENAI,
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]},
            "messages[1].content",
            "answer is missing",
        ),
        (
            OPENAI,
            {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "s"}]},
            "messages[1].role",
            "first only",
        ),
        (ALPACA, ["not", "a", "mapping"], "record", "JSON object"),
    ],
)
def test_a_bad_record_names_its_field_and_why(layout, record, field, words):
    with pytest.raises(RecordProblem) as raised:
        convert(record, layout)
    assert raised.value.field == field and words in raised.value.reason


def test_answer_spans_labels_and_the_cut():
    whole = [1, 2, 3, 4, 5, 6, 7, 8]
    # Two answers: prompts end at 3 and 6, renderings at 5 and 8.
    spans = answer_spans(whole, [2, 4], [[1, 2, 3], [1, 2, 3, 4, 5, 6]], [[1, 2, 3, 4, 5], whole])
    assert spans == [(3, 5), (6, 8)]
    i = IGNORE_INDEX
    assert labels_for(whole, spans, train_on_prompt=False, mask_history=False) == [i, i, i, 4, 5, i, 7, 8]
    assert labels_for(whole, spans, train_on_prompt=False, mask_history=True) == [i, i, i, i, i, i, 7, 8]
    assert labels_for(whole, spans, train_on_prompt=True, mask_history=False) == whole
    assert labels_for(whole, spans, train_on_prompt=True, mask_history=True) == [1, 2, 3, i, i, 6, 7, 8]
    assert kept_length(8, spans, 100, False) == 8
    assert kept_length(8, spans, 4, False) == 4  # the end is cut; one answer token is left
    assert kept_length(8, spans, 3, False) is None  # the prompt fills seq_len: no answer token
    assert kept_length(8, spans, 6, True) is None  # mask_history: the last answer lies beyond the cut
    with pytest.raises(PrefixBroken) as broken:
        answer_spans(whole, [2], [[1, 2, 9]], [whole])
    assert broken.value.turn == 2 and broken.value.position == 2
