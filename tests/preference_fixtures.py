"""Preference records in the shapes users keep them, made in the test (no downloads).

- `write_pairs`: LLaMA-Factory sharegpt `ranking: true` records (conversations + chosen/rejected turns)
  in a data folder with its dataset_info.json, so a run names them as users do (data.dataset_dir +
  data.dataset).
- `write_kto`: LLaMA-Factory sharegpt records with a `kto_tag` column.

The chosen answer follows a rule a small model can learn (it repeats the question's first words and ends
with "stones"), the rejected one is another random sentence: preference training visibly raises the
margin within an epoch.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from sft_fixtures import _sentence


def _pair(rng: random.Random, i: int) -> dict[str, Any]:
    question = _sentence(rng, 3, 8)
    convo = []
    if i % 4 == 1:
        convo.append({"from": "system", "value": _sentence(rng, 2, 4)})
    if i % 5 == 3:  # a turn of history before the question
        convo += [{"from": "human", "value": _sentence(rng)}, {"from": "gpt", "value": _sentence(rng)}]
    convo.append({"from": "human", "value": question})
    chosen = " ".join(question.split()[:3]) + " stones"
    return {
        "conversations": convo,
        "chosen": {"from": "gpt", "value": chosen},
        "rejected": {"from": "gpt", "value": _sentence(rng, 2, 9)},
    }


def write_pairs(folder: Path, n: int, seed: int = 0, name: str = "pairs") -> Path:
    """A LLaMA-Factory data folder holding `n` sharegpt ranking records as entry `name`."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps([_pair(rng, i) for i in range(n)], indent=1))
    info = {
        name: {
            "file_name": f"{name}.json",
            "formatting": "sharegpt",
            "ranking": True,
            "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"},
        }
    }
    _merge_info(folder, info)
    return folder


def write_kto(folder: Path, n: int, seed: int = 0, name: str = "kto") -> Path:
    """A LLaMA-Factory data folder holding `n` sharegpt records with a kto_tag, as entry `name`: every
    other record's answer is the rule's (desirable), the rest a random sentence (undesirable)."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        pair = _pair(rng, i)
        good = i % 3 != 2
        answer = pair["chosen"] if good else pair["rejected"]
        records.append({"messages": [*pair["conversations"], answer], "label": good})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(records, indent=1))
    info = {
        name: {
            "file_name": f"{name}.json",
            "formatting": "sharegpt",
            "columns": {"messages": "messages", "kto_tag": "label"},
        }
    }
    _merge_info(folder, info)
    return folder


def _merge_info(folder: Path, entries: dict[str, Any]) -> None:
    path = folder / "dataset_info.json"
    info = json.loads(path.read_text()) if path.exists() else {}
    info.update(entries)
    path.write_text(json.dumps(info, indent=1))
