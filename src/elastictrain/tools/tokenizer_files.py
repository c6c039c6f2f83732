"""The tokenizer written beside an exported model or adapter: the run's tokenizer files, copied as they
are, with the class the run tokenized with recorded in the copy's tokenizer_config.json where the copy
would otherwise load as another class.

Why record it: transformers 5's AutoTokenizer picks the class from config.json's `model_type` when the
folder has a config.json (a `qwen2` folder gives Qwen2Tokenizer, which splits numbers into digits),
and from tokenizer_config.json's `tokenizer_class` when it has none (`TokenizersBackend`, what
PreTrainedTokenizerFast.save_pretrained writes, tokenizes as tokenizer.json was saved). A pretrained
folder whose tokenizer_config.json names TokenizersBackend beside a qwen2 config.json trains with
Qwen2Tokenizer; copied into an adapter folder (no config.json), the same files would load as
TokenizersBackend and tokenize "2024" as "202" + "4" where the run saw four digits.

Each file is written under a temporary name in the folder and renamed over its name: the folder may be
a run folder (model.lora.export_dir = run.dir), and nothing else in it is touched.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastictrain.storage.durable import fsync_dir

# What transformers' tokenizers are saved as (the chat template in its own file since transformers 4.43).
TOKENIZER_FILES = {
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
}
CHAT_TEMPLATES = "additional_chat_templates"  # a folder of named templates beside the default one
CONFIG = "tokenizer_config.json"


@dataclass(frozen=True)
class CopiedTokenizer:
    files: list[str]  # the names copied (CHAT_TEMPLATES included where there was one)
    ran_with: str  # the class the source folder loads as: the one the run tokenized with
    loads_as: str  # the class the copy loads as, from its folder alone
    recorded: bool  # True: tokenizer_config.json's tokenizer_class was set to `ran_with`


def tokenizer_class(folder: str | Path) -> str:
    """The class AutoTokenizer loads `folder` as (what the run's data/hf_files.py load_tokenizer gives)."""
    return type(_load(folder)).__name__


def copy_tokenizer(source: str | Path, out: Path) -> CopiedTokenizer:
    """Copy `source`'s tokenizer files into `out` (which must exist); where the copy, loaded from `out`
    as it is (its config.json, if any, included), is another class than `source` loads as, set that
    class as tokenizer_config.json's tokenizer_class (written with it if the source had none)."""
    source = Path(source)
    ran_with = tokenizer_class(source)
    copied = sorted(p.name for p in source.iterdir() if p.name in TOKENIZER_FILES and p.is_file())
    for name in copied:
        replace_file(out / name, lambda tmp, name=name: shutil.copy2(source / name, tmp))
    if (source / CHAT_TEMPLATES).is_dir():
        _replace_folder(out / CHAT_TEMPLATES, lambda tmp: shutil.copytree(source / CHAT_TEMPLATES, tmp))
        copied.append(CHAT_TEMPLATES)
    loads_as = tokenizer_class(out)
    recorded = loads_as != ran_with
    if recorded:
        path = out / CONFIG
        config = json.loads(path.read_text()) if path.is_file() else {}
        config["tokenizer_class"] = ran_with
        text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
        replace_file(path, lambda tmp: tmp.write_text(text))
        if CONFIG not in copied:
            copied.append(CONFIG)
        loads_as = tokenizer_class(out)
    fsync_dir(out)
    return CopiedTokenizer(sorted(copied), ran_with, loads_as, recorded)


def replace_file(path: Path, write: Callable[[Path], Any]) -> None:
    """Write `path` as `write(tmp)` writes a temporary file beside it, then rename it over `path`
    (a reader sees the old file or the new one, never part of one)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")  # durable.remove_stale_temporaries' pattern
    try:
        write(tmp)
        fsync_dir(tmp)  # a file: opened read-only and fsynced
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _replace_folder(path: Path, write: Callable[[Path], Any]) -> None:
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # a crashed copy's
    try:
        write(tmp)
        if path.exists():
            path.rename(old)
        tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def _load(folder: str | Path) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # as the run loads it (data/hf_files.py load_tokenizer)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
