"""Preference records to a prompt (message list) and its answers. Pure: no torch, no transformers.

Shapes read, as LLaMA-Factory's converter and TRL spell them:
- alpaca, `ranking: true`: instruction + input (a newline between) as the user turn, optional system and
  history, and `chosen` / `rejected` answer texts.
- sharegpt, `ranking: true`: `conversations` (the prompt, ending with a user turn) and `chosen` /
  `rejected` single turns ({from: gpt, value}).
- trl: `prompt`, `chosen`, `rejected`, each text or a list of {role, content}; without `prompt`, chosen
  and rejected are whole conversations and the prompt is their common prefix.
- KTO: an sft-shaped record with LLaMA-Factory's `kto_tag` column, or TRL's `prompt`, `completion`, `label`.

A record that does not convert raises RecordProblem naming the field as the file spells it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from elastictrain.data.sft.records import (
    DEFAULT_COLUMNS,
    DEFAULT_TAGS,
    Layout,
    RecordProblem,
    convert,
    kind_of,
    listish,
    make_layout,
    message_of,
    tools_of,
)

PAIR_FORMATTINGS = ("alpaca", "sharegpt", "trl")
_ROLES = ("system", "user", "assistant", "tool")


@dataclass
class PreferencePair:
    prompt: list[dict[str, Any]]  # ends with a user (or tool) turn
    chosen: dict[str, Any]  # one assistant message
    rejected: dict[str, Any]
    tools: list[Any] | None = None


@dataclass
class KtoExample:
    prompt: list[dict[str, Any]]
    answer: dict[str, Any]
    desirable: bool
    tools: list[Any] | None = None


def pair_layout(formatting: str, columns: Mapping[str, Any] | None, tags: Mapping[str, Any] | None) -> Layout:
    """LLaMA-Factory's defaults plus chosen/rejected (and kto_tag where given); a mapping given names all."""
    if formatting == "trl":
        names = {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}
        return Layout("trl", dict(columns or names))
    if columns:
        return make_layout(formatting, columns, tags)
    cols: dict[str, Any] = dict(DEFAULT_COLUMNS[formatting])
    cols.pop("response", None)
    cols.update(chosen="chosen", rejected="rejected")
    return Layout(formatting, cols, dict(tags or DEFAULT_TAGS.get(formatting, {})))


def detect_pairs(record: Any) -> str | None:
    """The pair formatting of a record by its columns (None: not a preference record)."""
    if not isinstance(record, Mapping) or "chosen" not in record or "rejected" not in record:
        return None
    if "conversations" in record:
        return "sharegpt"
    return "alpaca" if "instruction" in record else "trl"


def to_pair(record: Any, layout: Layout, default_system: str | None = None) -> PreferencePair:
    if not isinstance(record, Mapping):
        raise RecordProblem("record", f"got {kind_of(record)}; expected a JSON object (a mapping of columns)")
    if layout.formatting == "trl":
        return _trl_pair(record, layout.columns, default_system)
    chosen_col, rejected_col = _col(layout, "chosen"), _col(layout, "rejected")
    if layout.formatting == "alpaca":
        chosen = _answer_text(record, chosen_col, "the preferred answer")
        rejected = _answer_text(record, rejected_col, "the dispreferred answer")
        # The sft converter builds the prompt (history, instruction + input, system) with chosen as answer.
        conv = convert(record, Layout("alpaca", {**layout.columns, "response": chosen_col}), default_system)
        return PreferencePair(conv.messages[:-1], chosen, rejected, conv.tools)
    chosen_turn = _answer_turn(record, chosen_col, layout, "the preferred answer")
    rejected_turn = _answer_turn(record, rejected_col, layout, "the dispreferred answer")
    col = str(layout.columns.get("messages"))
    turns = listish(record.get(col))
    if isinstance(turns, list) and turns and isinstance(turns[-1], Mapping):
        tag, role_tag = turns[-1].get(layout.tags.get("role_tag") or "from"), layout.tags.get("role_tag")
        if tag in (layout.tags.get("assistant_tag"), layout.tags.get("function_tag")):
            raise RecordProblem(
                f"{col}[{len(turns) - 1}].{role_tag}",
                f"got {tag!r}; expected the prompt to end with a {layout.tags.get('user_tag')!r} turn "
                "(the answers are chosen and rejected)",
            )
    # The prompt is checked by the sft converter, as a conversation with the chosen turn appended.
    turns_with = [*turns, record[chosen_col]] if isinstance(turns, list) else turns
    conv = convert({**record, col: turns_with}, layout, default_system)
    return PreferencePair(conv.messages[:-1], chosen_turn, rejected_turn, conv.tools)


def to_kto(record: Any, layout: Layout, default_system: str | None = None) -> KtoExample:
    """LLaMA-Factory's kto_tag on an sft-shaped record (layout: an sft one with columns.kto_tag), or
    TRL's prompt/completion/label (layout formatting trl)."""
    if not isinstance(record, Mapping):
        raise RecordProblem("record", f"got {kind_of(record)}; expected a JSON object (a mapping of columns)")
    if layout.formatting == "trl":
        label = _flag(record, "label")
        prompt = _trl_prompt(record, "prompt", default_system)
        return KtoExample(prompt, _trl_answer(record, "completion", "the answer"), label)
    flag = _flag(record, _col(layout, "kto_tag"))
    conv = convert(record, layout, default_system)
    return KtoExample(conv.messages[:-1], conv.messages[-1], flag, conv.tools)


def _col(layout: Layout, key: str) -> str:
    name = layout.columns.get(key)
    if not name:
        raise RecordProblem(f"columns.{key}", "missing; a columns mapping names every column read")
    return str(name)


def _flag(record: Mapping[str, Any], col: str) -> bool:
    value = record.get(col)
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"  # a CSV cell
    if not isinstance(value, bool):
        state = "missing" if value is None else f"got {kind_of(value)}"
        raise RecordProblem(col, f"{state}; expected true (a desirable answer) or false")
    return value


def _answer_text(record: Mapping[str, Any], col: str, what: str) -> dict[str, Any]:
    value = record.get(col)
    if value is None:
        raise RecordProblem(col, f"missing; expected {what}")
    if not isinstance(value, str):
        raise RecordProblem(col, f"got {kind_of(value)}; expected {what} (text)")
    if not value.strip():
        raise RecordProblem(col, f"empty; expected {what}")
    return {"role": "assistant", "content": value}


def _answer_turn(record: Mapping[str, Any], col: str, layout: Layout, what: str) -> dict[str, Any]:
    turn = record.get(col)
    role_tag, content_tag = str(layout.tags.get("role_tag")), str(layout.tags.get("content_tag"))
    answers = {layout.tags.get("assistant_tag"): "assistant", layout.tags.get("function_tag"): "function"}
    answers.pop(None, None)
    if not isinstance(turn, Mapping):
        state = "missing" if turn is None else f"got {kind_of(turn)}"
        raise RecordProblem(col, f"{state}; expected {what}: one turn with {role_tag} and {content_tag}")
    if turn.get(role_tag) not in answers:
        raise RecordProblem(
            f"{col}.{role_tag}", f"got {turn.get(role_tag)!r}; expected {' or '.join(map(repr, answers))}"
        )
    content = turn.get(content_tag)
    if isinstance(content, str) and not content.strip():
        raise RecordProblem(f"{col}.{content_tag}", f"empty; expected {what}")
    role = answers[turn[role_tag]]
    return message_of(turn, role, content_tag, col, layout.formatting == "openai")


def _trl_pair(
    record: Mapping[str, Any], cols: Mapping[str, Any], default_system: str | None
) -> PreferencePair:
    p, c, r = (str(cols.get(k) or k) for k in ("prompt", "chosen", "rejected"))
    tools = tools_of(record, "tools")
    if record.get(p) is not None:
        prompt = _trl_prompt(record, p, default_system)
        chosen = _trl_answer(record, c, "the preferred answer")
        return PreferencePair(prompt, chosen, _trl_answer(record, r, "the dispreferred answer"), tools)
    # Implicit prompt: chosen and rejected are whole conversations sharing their prompt turns.
    full = {k: _messages(record, k) for k in (c, r)}
    for k, what in ((c, "the preferred"), (r, "the dispreferred")):
        if full[k] is None or (isinstance(record.get(k), str) and not _json_messages(record[k])):
            raise RecordProblem(
                k,
                f"got {kind_of(record.get(k))} and no {p} column; expected {p}, or {what} conversation as "
                "a list of {role, content} messages",
            )
    a, b = full[c] or [], full[r] or []
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    for k, msgs in ((c, a), (r, b)):
        if len(msgs) != n + 1 or msgs[-1]["role"] != "assistant":
            where = f"{k}[{min(n, len(msgs) - 1)}]" if msgs else k
            raise RecordProblem(
                where,
                "expected chosen and rejected to share every message but a last assistant one "
                f"(they share {n})",
            )
    prompt = _with_system(a[:n], default_system, c)
    return PreferencePair(prompt, a[-1], b[-1], tools)


def _messages(record: Mapping[str, Any], col: str) -> list[dict[str, Any]] | None:
    """A list of {role, content} messages (None: the column is not a list)."""
    value = listish(record.get(col))
    if not isinstance(value, list):
        return None
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, Mapping) or m.get("role") not in _ROLES:
            got = m.get("role") if isinstance(m, Mapping) else kind_of(m)
            raise RecordProblem(f"{col}[{j}].role", f"got {got!r}; expected one of {', '.join(_ROLES)}")
        if not isinstance(m.get("content"), str):
            raise RecordProblem(f"{col}[{j}].content", f"got {kind_of(m.get('content'))}; expected text")
        out.append(dict(m))
    return out


def _json_messages(text: str) -> bool:
    """Text that is a JSON list of messages (a CSV cell); other text, "[1, 2]" included, is text."""
    value = listish(text)
    return isinstance(value, list) and bool(value) and all(isinstance(m, Mapping) for m in value)


def _trl_prompt(record: Mapping[str, Any], col: str, default_system: str | None) -> list[dict[str, Any]]:
    value = record.get(col)
    if isinstance(value, str) and not _json_messages(value):
        if not value.strip():
            raise RecordProblem(col, "empty; expected the prompt")
        return _with_system([{"role": "user", "content": value}], default_system, col)
    msgs = _messages(record, col)
    if msgs is None:
        state = "missing" if value is None else f"got {kind_of(value)}"
        raise RecordProblem(col, f"{state}; expected the prompt (text or a list of {{role, content}})")
    return _with_system(msgs, default_system, col)


def _with_system(msgs: list[dict[str, Any]], default_system: str | None, col: str) -> list[dict[str, Any]]:
    turns = [m for m in msgs if m["role"] != "system"]
    if not turns or turns[-1]["role"] not in ("user", "tool"):
        last = turns[-1]["role"] if turns else "no turn"
        raise RecordProblem(col, f"ends with {last!r}; expected the prompt to end with a user turn")
    if msgs[0]["role"] != "system" and default_system:
        return [{"role": "system", "content": default_system}, *msgs]
    return msgs


def _trl_answer(record: Mapping[str, Any], col: str, what: str) -> dict[str, Any]:
    value = record.get(col)
    if isinstance(value, str) and not _json_messages(value):
        return _answer_text(record, col, what)
    msgs = _messages(record, col)
    if msgs is None:
        return _answer_text(record, col, what)  # missing, or not text: named as such
    if len(msgs) != 1 or msgs[0]["role"] != "assistant":
        raise RecordProblem(col, f"got {len(msgs)} message(s); expected {what}: one assistant message")
    if not msgs[0]["content"].strip():
        raise RecordProblem(f"{col}[0].content", f"empty; expected {what}")
    return msgs[0]
