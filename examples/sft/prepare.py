"""Make what examples/sft/config.yaml starts from: a small "pretrained" chat model and chat records.

Nothing is downloaded. The tokenizer is a byte-level BPE trained on the records' own text, with ChatML
special tokens and chat template (as Qwen's); the base model is a small Llama with random weights, saved
with save_pretrained into the same folder as the tokenizer (as a model folder from the Hub holds both).
The records are small tasks on word lists (reverse, sort, count, repeat), written in two of
LLaMA-Factory's layouts and described by a dataset_info.json:

    OUT/sft-model/                 config.json, model.safetensors, tokenizer files with the chat template
    OUT/sft-data/dataset_info.json names word_tasks_alpaca (alpaca) and word_tasks_sharegpt (sharegpt)
    OUT/sft-data/*.json

    python examples/sft/prepare.py work/

With a real model, skip this: point model.pretrained at its folder and data.dataset_dir at your data.
"""

from __future__ import annotations

import json
import random
import string
import sys
from pathlib import Path
from typing import Any

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WORDS = (
    "apple", "river", "stone", "cloud", "lamp", "garden", "bridge", "north", "road", "storm",
    "valley", "station", "robot", "kite", "bread", "map", "shard", "report", "engine", "cluster",
    "worker", "train", "tree", "seed", "field", "paper", "green", "blue", "red", "quiet", "bright",
)  # fmt: skip
SYSTEM = "You are a careful assistant. Answer with the result only."


def _task(rng: random.Random) -> tuple[str, str, str]:
    """(instruction, input, answer) of one small task on a word list."""
    words = rng.sample(WORDS, rng.randint(2, 6))
    kind = rng.choice(("reverse", "sort", "count", "first", "repeat"))
    if kind == "reverse":
        return "Reverse the order of these words.", " ".join(words), " ".join(reversed(words))
    if kind == "sort":
        return "Sort these words alphabetically.", " ".join(words), " ".join(sorted(words))
    if kind == "count":
        return "How many words are there?", " ".join(words), str(len(words))
    if kind == "first":
        return "Which word comes first?", " ".join(words), words[0]
    return "Repeat the last word twice.", " ".join(words), f"{words[-1]} {words[-1]}"


def alpaca_records(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        instruction, query, answer = _task(rng)
        record: dict[str, Any] = {"instruction": instruction, "input": query, "output": answer}
        if i % 4 == 1:
            record["system"] = SYSTEM
        out.append(record)
    return out


def sharegpt_records(n: int, seed: int = 1) -> list[dict[str, Any]]:
    """Conversations of 1 to 3 turns, some with a system prompt."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        turns: list[dict[str, str]] = [{"from": "system", "value": SYSTEM}] if i % 3 == 0 else []
        for _ in range(1 + i % 3):
            instruction, query, answer = _task(rng)
            turns += [{"from": "human", "value": f"{instruction}\n{query}"}, {"from": "gpt", "value": answer}]
        out.append({"conversations": turns})
    return out


def write_data(out: Path, n: int = 200) -> Path:
    """n records of each layout and their dataset_info.json into `out`; returns `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "word_tasks_alpaca.json").write_text(json.dumps(alpaca_records(n), indent=1))
    (out / "word_tasks_sharegpt.json").write_text(json.dumps(sharegpt_records(n), indent=1))
    info = {
        "word_tasks_alpaca": {"file_name": "word_tasks_alpaca.json"},  # alpaca is the default formatting
        "word_tasks_sharegpt": {
            "file_name": "word_tasks_sharegpt.json",
            "formatting": "sharegpt",
            "columns": {"messages": "conversations"},
        },
    }
    (out / "dataset_info.json").write_text(json.dumps(info, indent=1))
    return out


def build_tokenizer(out: Path, vocab_size: int = 512) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = [" ".join(WORDS), SYSTEM, string.printable] + [
        " ".join(_task(random.Random(i))) for i in range(500)
    ]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    fast.chat_template = CHATML
    fast.save_pretrained(out)
    return fast


def build_base_model(tokenizer: Any, out: Path, *, hidden: int = 64, layers: int = 2, seed: int = 0) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(out)


def prepare(out: Path, records: int = 200, hidden: int = 64, layers: int = 2) -> tuple[Path, Path]:
    """OUT/sft-model (model and tokenizer) and OUT/sft-data (records and dataset_info.json)."""
    model_dir = out / "sft-model"
    tokenizer = build_tokenizer(model_dir)
    build_base_model(tokenizer, model_dir, hidden=hidden, layers=layers)
    return model_dir, write_data(out / "sft-data", records)


if __name__ == "__main__":
    model, data = prepare(Path(sys.argv[1] if len(sys.argv) > 1 else "work"))
    print(f"base model and tokenizer: {model}\ndata: {data}")
