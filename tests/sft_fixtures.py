"""Instruction data made in the test (no downloads), for tests of `data.source: sft`.

    from sft_fixtures import make_chatml_tokenizer, write_records   # tests/ is on sys.path

    tok = make_chatml_tokenizer(tmp_path / "tok")          # a folder for data.tokenizer
    path = write_records(tmp_path, "alpaca", 40)           # or "sharegpt", "openai"

The tokenizer is a byte-level BPE of fewer than 256 tokens (so the default tiny model's 256 embedding
rows fit it), trained with the `tokenizers` library on every character the records use, wrapped as a
PreTrainedTokenizerFast with `<|im_start|>`, `<|im_end|>` (its end-of-text token) and `<|endoftext|>`
(padding) as special tokens, and a ChatML chat template. Records are deterministic (a seed per
formatting): single- and multi-turn conversations, some with a system prompt.
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path
from typing import Any

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
FORMATTINGS = ("alpaca", "sharegpt", "openai")

_LINE = (
    "the fox sees a bright lamp near the bridge and counts seven stones before dawn while a robot "
    "repairs the north road after the storm our team trains every cluster under the stars"
)
_WORDS = _LINE.split(" ")
_TEXT = " ".join(_WORDS) + " user assistant system tool " + string.printable


def make_chatml_tokenizer(folder: Path) -> Path:
    """Save a ChatML tokenizer of < 256 tokens into `folder` (save_pretrained); returns the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=240, special_tokens=SPECIAL, show_progress=False)
    tokenizer.train_from_iterator([_TEXT] * 20, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<|endoftext|>", eos_token="<|im_end|>"
    )
    wrapped.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    wrapped.chat_template = CHATML
    folder.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(folder)
    return folder


def _sentence(rng: random.Random, low: int = 3, high: int = 10) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(low, high)))


def make_conversations(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """n conversations: {"system": str or None, "turns": [(user, assistant), ...]} (1 to 3 turns)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        turns = [(_sentence(rng), _sentence(rng)) for _ in range(1 + (i % 3 == 2) + (i % 5 == 4))]
        out.append({"system": _sentence(rng, 2, 4) if i % 4 == 1 else None, "turns": turns})
    return out


def to_record(conversation: dict[str, Any], formatting: str) -> dict[str, Any]:
    """One conversation in a formatting's own columns (alpaca, sharegpt, openai)."""
    system, turns = conversation["system"], conversation["turns"]
    if formatting == "alpaca":
        *history, (question, answer) = turns
        words = question.split()
        record: dict[str, Any] = {
            "instruction": " ".join(words[:2]),
            "input": " ".join(words[2:]),
            "output": answer,
        }
        if history:
            record["history"] = [list(t) for t in history]
        if system:
            record["system"] = system
        return record
    if formatting == "sharegpt":
        convo = [{"from": "system", "value": system}] if system else []
        for q, a in turns:
            convo += [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
        return {"conversations": convo}
    if formatting == "openai":
        messages = [{"role": "system", "content": system}] if system else []
        for q, a in turns:
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        return {"messages": messages}
    raise ValueError(f"formatting: got {formatting!r}; expected one of {', '.join(FORMATTINGS)}")


def write_records(folder: Path, formatting: str, n: int, seed: int | None = None) -> Path:
    """n records of `formatting` in folder/<formatting>.json (a JSON list; openai: .jsonl lines)."""
    seed = FORMATTINGS.index(formatting) if seed is None else seed
    records = [to_record(c, formatting) for c in make_conversations(n, seed)]
    folder.mkdir(parents=True, exist_ok=True)
    if formatting == "openai":
        path = folder / "openai.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        path = folder / f"{formatting}.json"
        path.write_text(json.dumps(records, indent=1))
    return path


def messages_of(record: dict[str, Any], formatting: str, system: str | None = None) -> list[dict[str, str]]:
    """The message list a record stands for (what the converter must produce), written out by hand."""
    if formatting == "alpaca":
        given = record.get("system") or system
        out = [{"role": "system", "content": given}] if given else []
        for q, a in record.get("history", []):
            out += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        query = "\n".join(x for x in (record["instruction"], record["input"]) if x)
        return [*out, {"role": "user", "content": query}, {"role": "assistant", "content": record["output"]}]
    key, role, content = (
        ("conversations", "from", "value") if formatting == "sharegpt" else ("messages", "role", "content")
    )
    names = {"human": "user", "gpt": "assistant"}
    out = [{"role": names.get(m[role], m[role]), "content": m[content]} for m in record[key]]
    if system and out[0]["role"] != "system":
        out.insert(0, {"role": "system", "content": system})
    return out


def write_dataset_info(
    folder: Path, extra: dict[str, Any] | None = None, qa: int = 10, chats: int = 8
) -> Path:
    """A LLaMA-Factory data folder: dataset_info.json naming `qa` (alpaca, columns renamed: question,
    context, answer; qa.json) and `chats` (sharegpt, columns and tags renamed: dialog of speaker/text
    turns, person/bot; a folder holding part-0.jsonl), plus `extra` entries. Returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    alpaca = [to_record(c, "alpaca") for c in make_conversations(qa, 0)]
    renamed = [{"question": r["instruction"], "context": r["input"], "answer": r["output"]} for r in alpaca]
    (folder / "qa.json").write_text(json.dumps(renamed))
    speaker = {"human": "person", "gpt": "bot"}
    dialogs = [
        {
            "dialog": [
                {"speaker": speaker.get(t["from"], t["from"]), "text": t["value"]} for t in r["conversations"]
            ]
        }
        for r in (to_record(c, "sharegpt") for c in make_conversations(chats, 1))
    ]
    (folder / "chats").mkdir(exist_ok=True)
    (folder / "chats" / "part-0.jsonl").write_text("".join(json.dumps(d) + "\n" for d in dialogs))
    info = {
        "qa": {
            "file_name": "qa.json",
            "columns": {"prompt": "question", "query": "context", "response": "answer"},
        },
        "chats": {
            "file_name": "chats",
            "formatting": "sharegpt",
            "columns": {"messages": "dialog"},
            "tags": {
                "role_tag": "speaker",
                "content_tag": "text",
                "user_tag": "person",
                "assistant_tag": "bot",
                "system_tag": "system",
            },
        },
        **(extra or {}),
    }
    (folder / "dataset_info.json").write_text(json.dumps(info))
    return folder
