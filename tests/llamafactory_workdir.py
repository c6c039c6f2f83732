"""A LLaMA-Factory working folder made in a test, as a user coming from it has one (no downloads):

folder/
  data/dataset_info.json   identity, alpaca_en_demo (alpaca), c4_demo (text, columns.prompt: text),
                           dpo_en_demo (sharegpt ranking pairs), kto_en_demo (sharegpt, kto_tag), each
                           entry as LLaMA-Factory's own dataset_info.json spells it
  examples/...             LLaMA-Factory's own example YAMLs and DeepSpeed JSONs, copied from
                           tests/llamafactory_files/ (its repository, Apache-2.0) with only sizes
                           made small (`shrink`)
hub/                       a Hugging Face cache holding Qwen/Qwen3-4B-Instruct-2507: a tiny model
                           saved with save_pretrained, laid out as the cache lays out a snapshot

from llamafactory_workdir import make_workdir, MODEL_ID
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import yaml
from sft_fixtures import make_conversations, to_record

FILES = Path(__file__).parent / "llamafactory_files"
MODEL_ID = "Qwen/Qwen3-4B-Instruct-2507"  # what the example YAMLs name
COMMIT = "0123456789abcdef0123456789abcdef01234567"
# Sizes of the examples made small enough for two CPU workers; every other key stays as the file has it.
SMALL = {
    "cutoff_len": 128,
    "max_samples": 24,
    "num_train_epochs": 1.0,
    "logging_steps": 1,
    "save_steps": 2,
    "gradient_accumulation_steps": 2,
    "per_device_train_batch_size": 2,
}


def cache_model(hub: Path, model_folder: Path, model_id: str = MODEL_ID) -> Path:
    """Place `model_folder` in a Hugging Face cache at `hub` as snapshot COMMIT of `model_id`."""
    repo = hub / ("models--" + model_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(model_folder, snapshot, dirs_exist_ok=True)
    return snapshot


def write_data(data: Path, records: int = 24) -> Path:
    data.mkdir(parents=True, exist_ok=True)
    conversations = make_conversations(2 * records, seed=3)
    identity = [to_record(c, "alpaca") for c in conversations[:records]]
    alpaca = [to_record(c, "alpaca") for c in conversations[records:]]
    (data / "identity.json").write_text(json.dumps(identity, indent=1))
    (data / "alpaca_en_demo.json").write_text(json.dumps(alpaca, indent=1))
    rng = random.Random(5)
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "while",
        "users",
        "ask",
        "and",
        "assistants",
        "answer",
    ]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 60))) for _ in range(records)]
    (data / "c4_demo.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    info = {
        "identity": {"file_name": "identity.json"},
        "alpaca_en_demo": {"file_name": "alpaca_en_demo.json"},
        "c4_demo": {"file_name": "c4_demo.jsonl", "columns": {"prompt": "text"}},
        **write_preference_data(data, records),
    }
    (data / "dataset_info.json").write_text(json.dumps(info, indent=1))
    return data


def write_preference_data(data: Path, records: int) -> dict[str, Any]:
    """dpo_en_demo and kto_en_demo in the shapes of LLaMA-Factory's demo files; their dataset_info entries."""
    pairs, kto = [], []
    for i, c in enumerate(make_conversations(2 * records, seed=7)):
        (question, answer), (_, other) = c["turns"][0], c["turns"][-1] if len(c["turns"]) > 1 else ("", "no")
        if i < records:
            pairs.append(
                {
                    "conversations": [{"from": "human", "value": question}],
                    "chosen": {"from": "gpt", "value": answer},
                    "rejected": {"from": "gpt", "value": other + " " + answer[::-1]},
                }
            )
        else:
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            kto.append({"messages": messages, "label": i % 3 != 0})
    (data / "dpo_en_demo.json").write_text(json.dumps(pairs, indent=1))
    (data / "kto_en_demo.json").write_text(json.dumps(kto, indent=1))
    roles = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}
    return {
        "dpo_en_demo": {
            "file_name": "dpo_en_demo.json",
            "ranking": True,
            "formatting": "sharegpt",
            "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"},
        },
        "kto_en_demo": {
            "file_name": "kto_en_demo.json",
            "formatting": "sharegpt",
            "columns": {"messages": "messages", "kto_tag": "label"},
            "tags": roles,
        },
    }


def shrink(path: Path, **changes: Any) -> dict[str, Any]:
    """Rewrite the YAML at `path` with SMALL's sizes (only keys it has) and `changes`; returns it."""
    raw = yaml.safe_load(path.read_text())
    raw.update({k: v for k, v in SMALL.items() if k in raw})
    raw.update(changes)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return raw


def make_workdir(root: Path, model_folder: Path) -> tuple[Path, Path]:
    """(working folder, cache) under `root`: data/, examples/ copied, the model cached as MODEL_ID."""
    work = root / "work"
    shutil.copytree(FILES / "examples", work / "examples")
    write_data(work / "data")
    hub = root / "hub"
    cache_model(hub, model_folder)
    return work, hub
