"""Preference prompts and answers to token ids through a chat template, and the cut at seq_len.

The prompt is rendered once (add_generation_prompt=True); each answer is the continuation of it: the
rendering of prompt + answer, whose tokens must begin with the prompt's (else the template renders the
prompt differently once an answer follows, and no answer span can be placed: TemplateProblem, as
render.py raises). An answer's ids are the tokens after the prompt's, end-of-turn markers included.

The cut follows LLaMA-Factory's pairwise processor: infer_seqlen splits data.seq_len between the prompt
(source) and the longer answer (target); the prompt keeps its start, each answer its start. A pair
where an answer keeps no token is dropped (None), and the builder counts it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from elastictrain.data.preference.records import KtoExample, PreferencePair
from elastictrain.data.sft.records import RecordProblem
from elastictrain.data.sft.render import TemplateProblem


@dataclass
class EncodedPair:
    prompt_ids: list[int]
    chosen_ids: list[int]  # the answer's tokens only, after prompt_ids
    rejected_ids: list[int]


@dataclass
class EncodedKto:
    prompt_ids: list[int]
    answer_ids: list[int]
    desirable: bool


def _render(tokenizer: Any, messages: list[dict[str, Any]], tools: Any, prompt: bool) -> str:
    return str(
        tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=prompt, tokenize=False)
    )


def _texts(tokenizer: Any, item: PreferencePair | KtoExample) -> list[str]:
    """The prompt's rendering, then prompt + each answer's."""
    answers = [item.chosen, item.rejected] if isinstance(item, PreferencePair) else [item.answer]
    try:
        texts = [_render(tokenizer, item.prompt, item.tools, True)]
        return texts + [_render(tokenizer, [*item.prompt, a], item.tools, False) for a in answers]
    except Exception as e:  # noqa: BLE001 - a template's raise_exception (or its bug) on this record
        raise RecordProblem("messages", f"the chat template refuses it: {type(e).__name__}: {e}") from None


def _answers(ids: Sequence[Sequence[int]], kinds: Sequence[str], name: str, origin: str) -> list[list[int]]:
    """ids: the prompt's, then prompt + each answer's; each answer's tokens after the prompt's."""
    head, *fulls = ids
    out = [list(head)]
    for which, full in zip(kinds, fulls, strict=True):
        at = next((i for i, t in enumerate(head) if i >= len(full) or full[i] != t), None)
        if at is not None:
            raise TemplateProblem(
                f"{origin}: cannot place the {which} answer of {name}: the prompt's tokens "
                "(add_generation_prompt=True) are not a prefix of the prompt + answer's (they differ at "
                f"token {at}); the template renders the prompt differently once an answer follows. Give "
                "data.template=FILE, a template that renders every turn the same whatever comes after it"
            )
        out.append(list(full[len(head) :]))
    return out


def encode_many(
    tokenizer: Any, items: Sequence[PreferencePair | KtoExample], names: Sequence[str], origin: str
) -> list[EncodedPair | EncodedKto | RecordProblem]:
    """Each item's ids, tokenized in one batched call (a template refusing an item: its RecordProblem).
    Raises TemplateProblem where a prompt is not a prefix of prompt + answer (`names` say which)."""
    rendered: list[list[str] | RecordProblem] = []
    for item in items:
        try:
            rendered.append(_texts(tokenizer, item))
        except RecordProblem as e:
            rendered.append(e)
    flat = [t for r in rendered if not isinstance(r, RecordProblem) for t in r]
    tokens = iter(tokenizer(flat, add_special_tokens=False)["input_ids"] if flat else [])
    out: list[EncodedPair | EncodedKto | RecordProblem] = []
    for item, name, r in zip(items, names, rendered, strict=True):
        if isinstance(r, RecordProblem):
            out.append(r)
            continue
        ids = [next(tokens) for _ in r]
        if isinstance(item, PreferencePair):
            head, chosen, rejected = _answers(ids, ("chosen", "rejected"), name, origin)
            out.append(EncodedPair(head, chosen, rejected))
        else:
            head, answer = _answers(ids, ("kto",), name, origin)
            out.append(EncodedKto(head, answer, item.desirable))
    return out


def encode_pair(tokenizer: Any, pair: PreferencePair, name: str, origin: str) -> EncodedPair:
    (out,) = encode_many(tokenizer, [pair], [name], origin)
    if isinstance(out, RecordProblem):
        raise out
    assert isinstance(out, EncodedPair)
    return out


def encode_kto(tokenizer: Any, example: KtoExample, name: str, origin: str) -> EncodedKto:
    (out,) = encode_many(tokenizer, [example], [name], origin)
    if isinstance(out, RecordProblem):
        raise out
    assert isinstance(out, EncodedKto)
    return out


def infer_seqlen(source_len: int, target_len: int, cutoff_len: int) -> tuple[int, int]:
    """LLaMA-Factory's split of cutoff_len (data/processor/processor_utils.py), unchanged."""
    if target_len * 2 < cutoff_len:  # truncate source
        max_target_len = cutoff_len
    elif source_len * 2 < cutoff_len:  # truncate target
        max_target_len = cutoff_len - source_len
    else:  # truncate both
        max_target_len = int(cutoff_len * (target_len / (source_len + target_len)))
    new_target_len = min(max_target_len, target_len)
    new_source_len = min(max(cutoff_len - new_target_len, 0), source_len)
    return new_source_len, new_target_len


def cut(pair: EncodedPair, seq_len: int) -> EncodedPair | None:
    """The pair cut so prompt + its longer answer fit seq_len; None where an answer keeps no token."""
    longer = max(len(pair.chosen_ids), len(pair.rejected_ids))
    source, target = infer_seqlen(len(pair.prompt_ids), longer, seq_len)
    chosen, rejected = pair.chosen_ids[:target], pair.rejected_ids[:target]
    if not chosen or not rejected:
        return None
    return EncodedPair(pair.prompt_ids[:source], chosen, rejected)


def cut_kto(example: EncodedKto, seq_len: int) -> EncodedKto | None:
    source, target = infer_seqlen(len(example.prompt_ids), len(example.answer_ids), seq_len)
    if target == 0:
        return None
    return EncodedKto(example.prompt_ids[:source], example.answer_ids[:target], example.desirable)
