"""What the model says at a validation (`eval.prompts`): the pure decisions.

Which tokenizer turns prompts into tokens and completions back into text, which part of a validation
record is its prompt, what every rank's completions make of one validation, and the table MLflow gets.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

BYTES = "bytes"  # the built-in byte tokenizer of data.source generated | file: token i is byte i
IGNORE_INDEX = -100  # labels with no loss: an instruction record's prompt, padding
TABLE_COLUMNS = ("step", "prompt", "completion", "reference")
TABLE_ARTIFACT = "eval_completions.json"  # mlflow.load_table reads it back (pandas' split layout)


def prompt_tokenizer(data: Any, pretrained: str | None) -> str | None:
    """BYTES, a tokenizer folder, or None when the run has none.

    `data` is the validation set's data options (eval.data, else data): what encoded its records must
    encode the prompts too. A pretrained model's folder holds the tokenizer it was trained with.
    """
    if data.source in ("generated", "file"):
        return BYTES
    return data.tokenizer or pretrained or None


def prompt_count(asked: int, records: int) -> int:
    """How many validation records give prompts: the first `asked`, at most the set's size."""
    return max(0, min(asked, records))


def split_record(
    ids: Sequence[int], labels: Sequence[int] | None = None, mask: Sequence[int] | None = None
) -> tuple[list[int], list[int]]:
    """(prompt, reference) of one validation record.

    Padding (mask 0) is dropped. A record whose labels start with ignored positions (an instruction
    record: no loss on the prompt) has those as its prompt and the rest as the reference answer;
    any other record (plain text) is cut in half.
    """
    keep = [i for i in range(len(ids)) if mask is None or mask[i]]
    tokens = [int(ids[i]) for i in keep]
    if labels is not None:
        kept = [int(labels[i]) for i in keep]
        lead = next((n for n, t in enumerate(kept) if t != IGNORE_INDEX), len(kept))
        if 0 < lead < len(tokens):
            return tokens[:lead], tokens[lead:]
    half = max(1, len(tokens) // 2)
    return tokens[:half], tokens[half:]


def keep_last(prompt: Sequence[int], positions: int | None, new_tokens: int) -> list[int]:
    """The prompt's last tokens that leave room for `new_tokens` within the model's positions."""
    if positions is None or len(prompt) + new_tokens <= positions:
        return list(prompt)
    room = max(1, positions - new_tokens)
    return list(prompt[-room:])


def rank_zero_completions(results: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, str]], bool]:
    """(rank 0's completions, whether every rank generated the same text).

    Under ZeRO-3 every rank runs every generation step (each forward gathers the parameters), so all
    ranks compute the same tokens; a difference would mean the ranks left lockstep.
    """
    answers = [(int(r.get("rank", 0)), c) for r in results if (c := r.get("completions")) is not None]
    if not answers:
        return [], True
    first = min(answers, key=lambda a: a[0])[1]
    texts = [[c["completion"] for c in completions] for _, completions in answers]
    return list(first), all(t == texts[0] for t in texts)


def table_rows(step: int, completions: Sequence[Mapping[str, str]]) -> list[list[Any]]:
    return [[step, c["prompt"], c["completion"], c.get("reference", "")] for c in completions]


def table(rows: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """The layout mlflow.log_table writes for a .json file (pandas' orient="split")."""
    return {"columns": list(TABLE_COLUMNS), "data": [list(r) for r in rows]}


def one_line(text: str, limit: int = 80) -> str:
    """A completion on one terminal line: newlines shown as \\n, the middle of a long one elided."""
    flat = text.replace("\r", "").replace("\n", "\\n")
    if len(flat) <= limit:
        return flat
    half = (limit - 3) // 2
    return flat[:half] + "..." + flat[-half:]
