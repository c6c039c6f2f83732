"""Instruction records in their common shapes to one message list (role, content), as LLaMA-Factory's
converter does. Pure: no torch, no transformers; a record that cannot convert raises RecordProblem naming
the field (the column or turn as the file spells it).

- alpaca: prompt (instruction) and query (input) joined by a newline as the user turn, response (output)
  as the answer, optional system, and history: [user, assistant] pairs of earlier turns.
- sharegpt: a list of turns {from, value}; roles human, gpt, system (first turn only), function_call
  (an answer that calls a tool), observation (a tool's result).
- openai: messages {role, content}; roles user, assistant (tool_calls kept), system, tool.

Turns after an optional system turn alternate: user or tool result, then assistant (or a tool call);
the last is an answer. Messages come out with roles system, user, assistant, tool, as transformers'
chat templates expect; a function_call turn becomes an assistant message with `tool_calls` where its
text is a JSON call ({"name", "arguments"}), the text itself otherwise. `columns` and `tags` rename as
LLaMA-Factory's dataset_info.json spells them; a mapping given names every column (tag) read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

FORMATTINGS = ("alpaca", "sharegpt", "openai")
COLUMN_KEYS = ("prompt", "query", "response", "history", "system", "messages", "tools")
TAG_KEYS = (
    "role_tag",
    "content_tag",
    "user_tag",
    "assistant_tag",
    "observation_tag",
    "function_tag",
    "system_tag",
)
# What each formatting reads when no mapping is given (alpaca's system and history only where present).
DEFAULT_COLUMNS: dict[str, dict[str, str]] = {
    "alpaca": {
        "prompt": "instruction",
        "query": "input",
        "response": "output",
        "history": "history",
        "system": "system",
        "tools": "tools",
    },
    "sharegpt": {"messages": "conversations", "system": "system", "tools": "tools"},
    "openai": {"messages": "messages", "system": "system", "tools": "tools"},
}
DEFAULT_TAGS: dict[str, dict[str, str | None]] = {
    "sharegpt": {
        "role_tag": "from",
        "content_tag": "value",
        "user_tag": "human",
        "assistant_tag": "gpt",
        "observation_tag": "observation",
        "function_tag": "function_call",
        "system_tag": "system",
    },
    "openai": {
        "role_tag": "role",
        "content_tag": "content",
        "user_tag": "user",
        "assistant_tag": "assistant",
        "observation_tag": "tool",
        "function_tag": None,  # calls are an assistant message's tool_calls
        "system_tag": "system",
    },
}
# Columns and tags a layout cannot do without.
REQUIRED = {
    "alpaca": ("columns.response",),
    "sharegpt": (
        "columns.messages",
        "tags.role_tag",
        "tags.content_tag",
        "tags.user_tag",
        "tags.assistant_tag",
    ),
}
REQUIRED["openai"] = REQUIRED["sharegpt"]
_ROLES = {
    "user_tag": "user",
    "assistant_tag": "assistant",
    "observation_tag": "tool",
    "function_tag": "function",
    "system_tag": "system",
}
_OPENAI_KEYS = ("tool_calls", "tool_call_id", "name")  # kept on openai messages, as templates read them


class RecordProblem(ValueError):
    """Why one record does not convert: `field` as the file names it, and the reason."""

    def __init__(self, field: str, reason: str) -> None:
        self.field, self.reason = field, reason
        super().__init__(f"{field}: {reason}")


@dataclass(frozen=True)
class Layout:
    """A formatting with its column and tag names."""

    formatting: str
    columns: Mapping[str, str | None]
    tags: Mapping[str, str | None] = field(default_factory=dict)


@dataclass
class Conversation:
    messages: list[dict[str, Any]]
    tools: list[Any] | None = None  # passed to the chat template as `tools`


def make_layout(formatting: str, columns: Mapping[str, Any] | None, tags: Mapping[str, Any] | None) -> Layout:
    cols = dict(columns) if columns else dict(DEFAULT_COLUMNS[formatting])
    tg = dict(tags) if tags else dict(DEFAULT_TAGS.get(formatting, {}))
    return Layout(formatting, cols, tg if formatting != "alpaca" else {})


def layout_problems(layout: Layout, where: str) -> list[str]:
    """Missing required columns or tags of a layout (`where` prefixes the field, e.g. 'data')."""
    given = {"columns": layout.columns, "tags": layout.tags}
    out = []
    for key in REQUIRED[layout.formatting]:
        part, name = key.split(".")
        if not given[part].get(name):
            out.append(
                f"{where}.{key}: missing for formatting {layout.formatting!r}; a {part} mapping names every "
                f"{part[:-1]} read (as in LLaMA-Factory's dataset_info.json), so give {name} too"
            )
    return out


def detect(record: Any, columns: Mapping[str, Any] | None, tags: Mapping[str, Any] | None) -> str | None:
    """The formatting a record is in (None: none matches), from the mappings given or its columns."""
    if not isinstance(record, Mapping):
        return None
    columns, tags = columns or {}, tags or {}
    names = [columns["messages"]] if columns.get("messages") else ["messages", "conversations"]
    for name in names:
        turns = listish(record.get(name))
        if isinstance(turns, list):
            first = next((t for t in turns if isinstance(t, Mapping)), {})
            role = tags.get("role_tag")
            if (role or "role") == "role" and "role" in first:
                return "openai"
            if role or "from" in first or name == "conversations":
                return "sharegpt"
            return "openai"
    alpaca = [columns.get("prompt"), columns.get("response")] if columns else ["instruction", "output"]
    if any(c and c in record for c in alpaca):
        return "alpaca"
    return None


def convert(record: Any, layout: Layout, default_system: str | None = None) -> Conversation:
    """One record as a message list (system first where there is one, else `default_system`)."""
    if not isinstance(record, Mapping):
        raise RecordProblem("record", f"got {kind_of(record)}; expected a JSON object (a mapping of columns)")
    messages = _alpaca(record, layout.columns) if layout.formatting == "alpaca" else _chat(record, layout)
    system = _text_column(record, layout.columns.get("system"))
    if messages and messages[0]["role"] == "system":
        system, messages = messages[0]["content"], messages[1:]
    system = system or default_system
    head = [{"role": "system", "content": system}] if system else []
    return Conversation(head + messages, tools_of(record, layout.columns.get("tools")))


def _alpaca(record: Mapping[str, Any], cols: Mapping[str, str | None]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    history_col = cols.get("history")
    history = listish(record.get(history_col)) if history_col else None
    if history is not None and not isinstance(history, list):
        raise RecordProblem(
            str(history_col), f"got {kind_of(history)}; expected a list of [user, assistant] pairs"
        )
    for j, pair in enumerate(history or []):
        if not (isinstance(pair, list | tuple) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise RecordProblem(
                f"{history_col}[{j}]", f"got {_short(pair)}; expected a [user, assistant] pair"
            )
        messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    parts, present = [], False
    for key in ("prompt", "query"):
        text = _text_column(record, cols.get(key))
        present = present or bool(cols.get(key) and record.get(str(cols.get(key))) is not None)
        if text:
            parts.append(text)
    if not parts:
        name = cols.get("prompt") or cols.get("query") or "prompt"
        state = "empty" if present else "missing"
        raise RecordProblem(str(name), f"{state}; expected the instruction text (an empty conversation)")
    response = str(cols.get("response"))
    answer = record.get(response)
    if answer is None:
        raise RecordProblem(response, "missing; expected the answer text")
    if not isinstance(answer, str):
        raise RecordProblem(response, f"got {kind_of(answer)}; expected the answer text")
    if not answer.strip():
        raise RecordProblem(response, "empty; expected the answer text")
    return [
        *messages,
        {"role": "user", "content": "\n".join(parts)},
        {"role": "assistant", "content": answer},
    ]


def _chat(record: Mapping[str, Any], layout: Layout) -> list[dict[str, Any]]:
    col, tags = str(layout.columns.get("messages")), layout.tags
    turns = listish(record.get(col))
    if turns is None:
        raise RecordProblem(col, "missing; expected a list of turns")
    if not isinstance(turns, list):
        raise RecordProblem(col, f"got {kind_of(turns)}; expected a list of turns")
    if not turns:
        raise RecordProblem(col, "an empty conversation; expected turns ending with an answer")
    role_tag, content_tag = str(tags.get("role_tag")), str(tags.get("content_tag"))
    roles = {tags[k]: role for k, role in _ROLES.items() if tags.get(k)}
    out: list[tuple[int, Any, dict[str, Any]]] = []  # (turn index, tag, message)
    for j, turn in enumerate(turns):
        where = f"{col}[{j}]"
        if not isinstance(turn, Mapping):
            raise RecordProblem(
                where, f"got {kind_of(turn)}; expected a mapping with {role_tag} and {content_tag}"
            )
        tag = turn.get(role_tag)
        if not isinstance(tag, str) or tag not in roles:
            raise RecordProblem(
                f"{where}.{role_tag}", f"got {tag!r}; expected one of {', '.join(map(str, roles))}"
            )
        message = message_of(turn, roles[tag], content_tag, where, layout.formatting == "openai")
        if message["role"] == "system" and j > 0:
            raise RecordProblem(
                f"{where}.{role_tag}", f"got {tag!r} at turn {j}; a system turn comes first only"
            )
        out.append((j, tag, message))
    _check_order(out, col, role_tag, tags)
    return [m for _, _, m in out]


def message_of(
    turn: Mapping[str, Any], role: str, content_tag: str, where: str, openai: bool
) -> dict[str, Any]:
    content = turn.get(content_tag)
    calls = turn.get("tool_calls") if openai and role == "assistant" else None
    if content is None and calls:
        content = ""
    if not isinstance(content, str):
        raise RecordProblem(f"{where}.{content_tag}", f"got {kind_of(content)}; expected text")
    if role == "function":
        if not content.strip():
            raise RecordProblem(f"{where}.{content_tag}", "empty; a tool call is missing")
        return _function_call(content)
    message: dict[str, Any] = {"role": role, "content": content}
    if openai:
        message.update({k: turn[k] for k in _OPENAI_KEYS if turn.get(k) is not None})
    if role == "assistant" and not content.strip() and not calls:
        raise RecordProblem(f"{where}.{content_tag}", "empty; an answer is missing")
    return message


def _function_call(text: str) -> dict[str, Any]:
    """A sharegpt function_call turn: tool_calls where its text is a JSON call, else the text itself."""
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    calls = parsed if isinstance(parsed, list) else [parsed]
    if calls and all(isinstance(c, Mapping) and isinstance(c.get("name"), str) for c in calls):
        functions = [{"name": c["name"], "arguments": c.get("arguments", {})} for c in calls]
        return {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": f} for f in functions],
        }
    return {"role": "assistant", "content": text}


def _check_order(
    out: list[tuple[int, Any, dict[str, Any]]], col: str, role_tag: str, tags: Mapping[str, Any]
) -> None:
    """After the system turn: user or tool result(s), then an answer, repeated; the last is an answer."""
    asks = " or ".join(repr(t) for t in (tags.get("user_tag"), tags.get("observation_tag")) if t)
    answers = " or ".join(repr(t) for t in (tags.get("assistant_tag"), tags.get("function_tag")) if t)
    turns = [(j, tag, m["role"]) for j, tag, m in out if m["role"] != "system"]
    expect_answer, previous = False, None
    for j, tag, role in turns:
        is_answer = role == "assistant"
        if role == "tool" and previous == "tool":
            continue  # several tool results in a row answer one call
        if is_answer != expect_answer:
            want = answers if expect_answer else asks
            after = "" if previous is None else f" after a {previous} turn"
            raise RecordProblem(
                f"{col}[{j}].{role_tag}", f"got {tag!r}{after}; expected {want} (roles out of order)"
            )
        expect_answer, previous = not expect_answer, role
    if not turns:
        raise RecordProblem(
            col, "an empty conversation (a system turn only); expected turns ending with an answer"
        )
    if turns[-1][2] != "assistant":
        raise RecordProblem(
            col, f"ends with a {turns[-1][1]!r} turn; expected the last turn to be an answer ({answers})"
        )


def _text_column(record: Mapping[str, Any], col: str | None) -> str | None:
    if not col or record.get(col) is None:
        return None
    value = record[col]
    if not isinstance(value, str):
        raise RecordProblem(col, f"got {kind_of(value)}; expected text")
    return value or None


def tools_of(record: Mapping[str, Any], col: str | None) -> list[Any] | None:
    value = record.get(col) if col else None
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise RecordProblem(
                str(col), "not valid JSON; expected a list of tool (function) schemas"
            ) from None
    if isinstance(value, Mapping):
        value = [value]
    if not isinstance(value, list):
        raise RecordProblem(str(col), f"got {kind_of(value)}; expected a list of tool (function) schemas")
    return value or None


def listish(value: Any) -> Any:
    """A list as such, or as JSON text (a CSV cell); anything else as it is."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            return json.loads(value)
        except ValueError:
            return value
    if isinstance(value, tuple):
        return list(value)
    return value


def kind_of(value: Any) -> str:
    names = {
        str: "text",
        list: "a list",
        dict: "a mapping",
        int: "a number",
        float: "a number",
        bool: "true/false",
    }
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _short(value: Any, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."
