"""Tool calls and tool lists as text (`data.tool_format`), and the check that a rendering kept them.

Pure: no torch, no transformers. A conversation (records.py) carries calls as an assistant message's
`tool_calls` and the tool list as `Conversation.tools`; a chat template renders them or not. With a
tool format the messages carry them as text instead, which every template renders:

- json: the system turn ends with a short preamble and the tools as one JSON list; a call is the JSON
  object {"name": ..., "arguments": ...} in the answer's text (one line per call, after any text of
  the answer); a tool result stays a `tool` message where the template renders that role, else it
  becomes a `user` message "Tool result:\n..." (results in a row joined in one message).
- qwen (LLaMA-Factory's qwen format, as Qwen2.5 and Hermes templates write it): the system turn ends
  with "# Tools" instructions and the tools inside <tools></tools>, one JSON object per line; a call is
  <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>; tool results are a `user` message of
  <tool_response>\n...\n</tool_response> blocks (results in a row in one message).

Without a system turn, the tool text is the system turn. `lost_parts` says what a rendering left out.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from elastictrain.data.sft.records import Conversation

TOOL_FORMATS = ("json", "qwen")
JSON_PREAMBLE = (
    "You may call the tools below. To call one, reply with a JSON object per call, one per line: "
    '{"name": <tool name>, "arguments": <an object of its arguments>}; its result comes in the next turn.'
    "\nTools (JSON schemas):\n"
)
# LLaMA-Factory's qwen tool prompt: the tools go between <tools> and </tools>, one object per line.
QWEN_TOOLS_HEAD = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
QWEN_TOOLS_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\n</tool_call>'
)
JSON_RESULT_PREFIX = "Tool result:\n"


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def call_parts(call: Any) -> tuple[str, Any]:
    """(name, arguments) of one tool_calls entry ({"function": {...}} or {"name", "arguments"}); string
    arguments that are JSON come back parsed."""
    fn = call.get("function", call) if isinstance(call, Mapping) else {}
    fn = fn if isinstance(fn, Mapping) else {}
    arguments = fn.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):
            arguments = json.loads(arguments)
    return str(fn.get("name", "")), {} if arguments is None else arguments


def calls_of(message: Mapping[str, Any]) -> list[tuple[str, Any]]:
    calls = message.get("tool_calls") or []
    return [call_parts(c) for c in (calls if isinstance(calls, list) else [calls])]


def tool_names(tools: Sequence[Any] | None) -> list[str]:
    """The names of a tool list's tools ({"name"} or {"type": "function", "function": {"name"}})."""
    out = []
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str) and fn["name"]:
            out.append(fn["name"])
    return out


def tools_text(tools: Sequence[Any], fmt: str) -> str:
    """What a tool format appends to the system turn."""
    if fmt == "json":
        return "\n\n" + JSON_PREAMBLE + _dumps(list(tools))
    lines = "".join(
        "\n" + _dumps(t if isinstance(t, Mapping) and t.get("type") == "function" else wrap(t)) for t in tools
    )
    return QWEN_TOOLS_HEAD + lines + QWEN_TOOLS_TAIL


def wrap(tool: Any) -> dict[str, Any]:
    return {"type": "function", "function": tool}


def calls_text(calls: Sequence[tuple[str, Any]], fmt: str) -> str:
    objects = [_dumps({"name": name, "arguments": arguments}) for name, arguments in calls]
    if fmt == "json":
        return "\n".join(objects)
    return "\n".join(f"<tool_call>\n{o}\n</tool_call>" for o in objects)


def with_tool_format(conversation: Conversation, fmt: str | None, tool_role: bool = True) -> Conversation:
    """The conversation with its calls, tool results and tools as text (`fmt` None: as it is).

    `tool_role`: whether the chat template renders a `tool` message (json keeps the role then).
    """
    if fmt is None:
        return conversation
    if fmt not in TOOL_FORMATS:
        raise ValueError(f"data.tool_format: got {fmt!r}; expected one of {', '.join(TOOL_FORMATS)} or null")
    messages: list[dict[str, Any]] = []
    after_result = False  # the last message is a tool result written as a user turn
    for message in conversation.messages:
        role = message.get("role")
        as_user = role == "tool" and not (fmt == "json" and tool_role)
        if as_user:
            block, sep = result_text(str(message.get("content") or ""), fmt)
            if after_result:  # results in a row: one user turn
                messages[-1]["content"] += sep + block
            else:
                messages.append({"role": "user", "content": block})
        elif role == "assistant" and message.get("tool_calls"):
            content = str(message.get("content") or "")
            text = calls_text(calls_of(message), fmt)
            messages.append({"role": "assistant", "content": f"{content}\n{text}" if content else text})
        else:
            messages.append(dict(message))
        after_result = as_user
    if conversation.tools:
        text = tools_text(conversation.tools, fmt)
        if messages and messages[0].get("role") == "system":
            messages[0] = {**messages[0], "content": str(messages[0].get("content") or "") + text}
        else:
            messages.insert(0, {"role": "system", "content": text.lstrip("\n")})
    return Conversation(messages, None)


def result_text(content: str, fmt: str) -> tuple[str, str]:
    """(a tool result as a user turn's text, the separator of results in a row)."""
    if fmt == "qwen":
        return f"<tool_response>\n{content}\n</tool_response>", "\n"
    return JSON_RESULT_PREFIX + content, "\n\n"


def _forms(value: Any) -> list[str]:
    """How a template may write a scalar: as JSON, as Python's str, a string raw or escaped."""
    if isinstance(value, str):
        return [value, _dumps(value)[1:-1], json.dumps(value)[1:-1]]
    if isinstance(value, bool) or value is None:
        return [json.dumps(value), str(value)]
    return [json.dumps(value), str(value)]


def _leaves(value: Any, where: str = "") -> list[tuple[str, Any]]:
    """(path, scalar) of each key and value inside a call's arguments."""
    if isinstance(value, Mapping):
        out: list[tuple[str, Any]] = []
        for key, item in value.items():
            path = f"{where}.{key}" if where else str(key)
            out.append((f"argument name {path!r}", str(key)))
            out += _leaves(item, path)
        return out
    if isinstance(value, list | tuple):
        return [leaf for j, item in enumerate(value) for leaf in _leaves(item, f"{where}[{j}]")]
    return [(f"the value of argument {where!r}" if where else "its arguments", value)]


def missing_from_call(text: str, name: str, arguments: Any) -> str | None:
    """What of a call (name, arguments) `text` does not hold, or None."""
    if name not in text:
        return "its name"
    for what, value in _leaves(arguments):
        if not any(form in text for form in _forms(value)):
            return what
    return None


def is_blank(text: str, marks: Sequence[str]) -> bool:
    """Whether `text` (an answer's trained tokens) holds nothing but whitespace and template marks."""
    for mark in sorted({m.strip() for m in marks if m and m.strip()}, key=len, reverse=True):
        text = text.replace(mark, "")
    return not text.strip()


def lost_parts(
    original: Conversation, answers: Sequence[str], prompt: str, marks: Sequence[str]
) -> list[tuple[str, str]]:
    """(kind, what) left out of a rendering: kind call (a call not in its answer's tokens), tool (a tool
    name not in the prompt tokens) or blank (an answer trained as template marks only).

    `answers`: each assistant turn's trained text, in order; `prompt`: the text of every other token.
    """
    out: list[tuple[str, str]] = []
    turns = [m for m in original.messages if m.get("role") == "assistant"]
    for j, (message, text) in enumerate(zip(turns, answers, strict=True)):
        calls = calls_of(message)
        missing = [(n, a, w) for n, a in calls if (w := missing_from_call(text, n, a)) is not None]
        for name, arguments, what in missing:
            out.append(
                (
                    "call",
                    f"answer {j + 1}: the call {name} {_short(arguments)} is not in its answer tokens, "
                    f"{_short(text)} ({what} missing)",
                )
            )
        has_content = bool(str(message.get("content") or "").strip())
        if not missing and (has_content or calls) and is_blank(text, marks):
            out.append(("blank", f"answer {j + 1}'s tokens are {_short(text)} only: its content is left out"))
    absent = [name for name in dict.fromkeys(tool_names(original.tools)) if name not in prompt]
    if absent:
        several = len(absent) > 1
        out.append(
            (
                "tool",
                f"the tool{'s' * several} {', '.join(absent)} {'are' if several else 'is'} not in the prompt",
            )
        )
    return out


def _short(value: Any, width: int = 60) -> str:
    text = value if isinstance(value, str) else _dumps(value)
    text = repr(text) if isinstance(value, str) else text
    return text if len(text) <= width else text[: width - 3] + "..."
