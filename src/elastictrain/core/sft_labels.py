"""Which tokens of a rendered conversation are trained, and where a long one is cut (`data.source: sft`).

A conversation is rendered whole by its chat template, and once more for each assistant turn k: the
turns before it with the generation prompt (its prompt), and the turns up to it (its end). The tokens
from the prompt's end to the end's end are the answer's; everything else is prompt. That holds only
when each of those renderings is a prefix of the whole one (in tokens): `answer_spans` checks it.
"""

from __future__ import annotations

from collections.abc import Sequence

IGNORE_INDEX = -100  # labels with no loss, as in transformers


class PrefixBroken(ValueError):
    """A partial rendering is not a prefix of the whole conversation's tokens."""

    def __init__(self, turn: int, what: str, position: int) -> None:
        self.turn, self.what, self.position = turn, what, position
        super().__init__(f"message {turn}: {what} differs from the whole conversation at token {position}")


def _first_difference(part: Sequence[int], whole: Sequence[int]) -> int | None:
    for i, token in enumerate(part):
        if i >= len(whole) or whole[i] != token:
            return i
    return None


def answer_spans(
    whole: Sequence[int],
    turns: Sequence[int],
    prompts: Sequence[Sequence[int]],
    ends: Sequence[Sequence[int]],
) -> list[tuple[int, int]]:
    """[start, end) token spans of the assistant turns (message indices `turns`) in `whole`.

    prompts[j]: the rendering of the messages before turn j with the generation prompt; ends[j]: of the
    messages up to and including it. Raises PrefixBroken where either is not a prefix of `whole`.
    """
    spans: list[tuple[int, int]] = []
    for turn, prompt, end in zip(turns, prompts, ends, strict=True):
        for what, part in (("its prompt (add_generation_prompt=True)", prompt), ("its rendering", end)):
            at = _first_difference(part, whole)
            if at is not None:
                raise PrefixBroken(turn, what, at)
        if len(end) < len(prompt) or (spans and len(prompt) < spans[-1][1]):
            raise PrefixBroken(turn, "its rendering", min(len(end), len(prompt)))
        spans.append((len(prompt), len(end)))
    return spans


def trained_spans(answers: Sequence[tuple[int, int]], mask_history: bool) -> list[tuple[int, int]]:
    """The answers trained on: all of them, or only the last with `mask_history`."""
    return list(answers[-1:] if mask_history else answers)


def labels_for(
    ids: Sequence[int], answers: Sequence[tuple[int, int]], *, train_on_prompt: bool, mask_history: bool
) -> list[int]:
    """Labels (unshifted): the token where trained, IGNORE_INDEX elsewhere.

    Answers are trained (only the last with mask_history, as LLaMA-Factory); the prompt tokens too with
    train_on_prompt (earlier answers stay masked when mask_history is also set).
    """
    labels = list(ids) if train_on_prompt else [IGNORE_INDEX] * len(ids)
    trained = trained_spans(answers, mask_history)
    for start, end in answers:
        keep = (start, end) in trained
        labels[start:end] = list(ids[start:end]) if keep else [IGNORE_INDEX] * (end - start)
    return labels


def kept_length(
    length: int, answers: Sequence[tuple[int, int]], seq_len: int, mask_history: bool
) -> int | None:
    """How many tokens of a record are kept: the end is cut at `seq_len` (LLaMA-Factory's side).

    None when the cut would keep no trained answer token that is also a target (position >= 1, as
    labels are shifted by one): the prompt alone fills `seq_len`, or mask_history's last answer lies
    beyond it. Such a record is dropped rather than trained with no target (it would teach nothing).
    """
    kept = min(length, seq_len)
    for start, end in trained_spans(answers, mask_history):
        if max(start, 1) < min(end, kept):
            return kept
    return None
