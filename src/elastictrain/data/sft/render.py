"""Conversations to token ids and answer spans, through a chat template.

The template is the tokenizer's own (`data.tokenizer`, else `model.pretrained`'s folder) or
`data.template` (a Jinja chat template file). A conversation's ids are its whole rendering, tokenized
as `apply_chat_template` does (no special tokens added). Assistant turn k's prompt is the rendering of
the turns before it with the generation prompt; its answer runs from there to the end of the rendering
of the turns up to it (core/sft_labels.py). Renderings are tokenized in one batched call per chunk.

With `data.tool_format` the calls, tool results and tools are written into the messages' text first
(tool_text.py). Either way each rendering is checked to hold what the record has: every call (name and
arguments) in its answer's tokens, every tool's name in the prompt's, and no answer rendered as
template markers only; what is left out comes back in `Encoded.lost`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastictrain.core.sft_labels import PrefixBroken, answer_spans
from elastictrain.data.sft.records import Conversation, RecordProblem
from elastictrain.data.sft.tool_text import lost_parts, with_tool_format

_PROBE = "elastictrain-probe-7f3a"  # text no template writes of its own


class TemplateProblem(ValueError):
    """The chat template cannot serve (none, or one whose partial renderings are not prefixes)."""


@dataclass
class Encoded:
    ids: list[int]
    answers: list[tuple[int, int]]  # [start, end) of each assistant turn, in order
    lost: list[tuple[str, str]] = field(default_factory=list)  # (kind, what): tool_text.lost_parts


@dataclass(frozen=True)
class TemplateFacts:
    """What one probe of a chat template shows: whether it renders a `tool` message, and the text it
    writes around an answer (with the tokenizer's special tokens: what an empty answer trains as)."""

    tool_role: bool
    marks: tuple[str, ...]


def template_facts(tokenizer: Any) -> TemplateFacts:
    ask = {"role": "user", "content": "hi"}
    specials = tuple(str(t) for t in getattr(tokenizer, "all_special_tokens", []) or [])
    marks: tuple[str, ...] = ()
    try:
        whole = _render(tokenizer, [ask, {"role": "assistant", "content": _PROBE}], None, False)
        answer = whole[len(_render(tokenizer, [ask], None, True)) :]
        if _PROBE in answer:
            marks = tuple(answer.split(_PROBE, 1))
    except Exception:  # noqa: BLE001 - a template refusing the probe: special tokens are the marks
        pass
    result = [ask, {"role": "assistant", "content": "call"}, {"role": "tool", "content": _PROBE}]
    try:
        tool_role = _PROBE in _render(
            tokenizer, [*result, {"role": "assistant", "content": "ok"}], None, False
        )
    except Exception:  # noqa: BLE001 - a template refusing role tool
        tool_role = False
    return TemplateFacts(tool_role, marks + specials)


def template_origin(data: Any, pretrained: str | None) -> str:
    """Where the template comes from, as messages name it."""
    if data.template:
        return f"data.template {data.template!r}"
    if data.tokenizer:
        return f"the chat template of data.tokenizer {data.tokenizer!r}"
    return f"the chat template of model.pretrained {pretrained!r}"


def chat_tokenizer(data: Any, pretrained: str | None) -> Any:
    """The tokenizer of `data.tokenizer` (else model.pretrained's), with data.template when given."""
    from elastictrain.data.hf_files import load_tokenizer

    folder = data.tokenizer or pretrained
    if not folder:
        raise TemplateProblem(
            "data.tokenizer: missing; expected a local tokenizer folder (or model.pretrained, whose folder "
            "holds one) for data.source sft"
        )
    tokenizer = load_tokenizer(folder)
    if data.template:
        try:
            tokenizer.chat_template = Path(data.template).read_text(encoding="utf-8")
        except OSError as e:
            raise TemplateProblem(f"data.template: got {data.template!r}; cannot read it ({e})") from e
    if not getattr(tokenizer, "chat_template", None):
        field = "data.tokenizer" if data.tokenizer else "model.pretrained"
        raise TemplateProblem(
            f"{field}: {folder!r} has no chat template; give data.template=FILE (a Jinja chat template, "
            "e.g. the chat_template.jinja of a model of the same family)"
        )
    return tokenizer


def pad_id(tokenizer: Any) -> int:
    """What records are padded with: the tokenizer's pad token, else its end of sequence, else 0."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return int(pad) if pad is not None else 0


def _render(tokenizer: Any, messages: list[dict[str, Any]], tools: Any, prompt: bool) -> str:
    return str(
        tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=prompt, tokenize=False)
    )


def renderings(tokenizer: Any, conversation: Conversation) -> tuple[list[int], list[str]]:
    """(assistant message indices, texts): the whole conversation, then each answer's prompt and end."""
    messages, tools = conversation.messages, conversation.tools
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    texts = [_render(tokenizer, messages, tools, False)]
    for k in turns:
        texts.append(_render(tokenizer, messages[:k], tools, True))
        texts.append(
            texts[0] if k == len(messages) - 1 else _render(tokenizer, messages[: k + 1], tools, False)
        )
    return turns, texts


def encode(
    tokenizer: Any,
    conversations: Sequence[Conversation],
    names: Sequence[str],
    origin: str,
    tool_format: str | None = None,
    facts: TemplateFacts | None = None,
) -> list[Encoded | RecordProblem]:
    """Each conversation's ids and answer spans, or why the template refuses it (a record problem).

    Raises TemplateProblem where the template breaks the prefix property (`names` say which record).
    """
    facts = facts or template_facts(tokenizer)
    rendered: list[tuple[list[int], list[str]] | RecordProblem] = []
    for conversation in conversations:
        try:
            shown = with_tool_format(conversation, tool_format, facts.tool_role)
            rendered.append(renderings(tokenizer, shown))
        except Exception as e:  # noqa: BLE001 - a template's raise_exception (or its bug) on this record
            rendered.append(
                RecordProblem("messages", f"the chat template refuses it: {type(e).__name__}: {e}")
            )
    texts = [t for r in rendered if not isinstance(r, RecordProblem) for t in r[1]]
    tokens = iter(tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
    out: list[Encoded | RecordProblem] = []
    for name, conversation, r in zip(names, conversations, rendered, strict=True):
        if isinstance(r, RecordProblem):
            out.append(r)
            continue
        turns, parts = r
        ids = [next(tokens) for _ in parts]
        try:
            spans = answer_spans(ids[0], turns, ids[1::2], ids[2::2])
        except PrefixBroken as e:
            raise TemplateProblem(
                f"{origin}: cannot place the labels of {name}: at message {e.turn} (an answer), {e.what} "
                f"is not a prefix of the whole conversation's tokens (they differ at token {e.position}); "
                "the template renders earlier turns differently once later ones follow. Give "
                "data.template=FILE, a template that renders every turn the same whatever comes after it"
            ) from None
        out.append(Encoded(list(ids[0]), spans))
        out[-1].lost = _lost(tokenizer, conversation, out[-1], facts)
    return out


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))


def _lost(
    tokenizer: Any, conversation: Conversation, enc: Encoded, facts: TemplateFacts
) -> list[tuple[str, str]]:
    """What of the record the tokens leave out: calls and non-empty answers in the answer spans, tool
    names in the prompt (every token outside them)."""
    answers = [_decode(tokenizer, enc.ids[a:b]) for a, b in enc.answers]
    prompt = ""
    if conversation.tools:
        cuts = [0, *(x for span in enc.answers for x in span), len(enc.ids)]
        prompt = "".join(_decode(tokenizer, enc.ids[a:b]) for a, b in zip(cuts[::2], cuts[1::2], strict=True))
    return lost_parts(conversation, answers, prompt, facts.marks)
