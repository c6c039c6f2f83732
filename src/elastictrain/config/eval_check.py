"""The `eval` section: its own data source inherits `data`'s options, and its values are checked."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from elastictrain.config.schema import Config, DataConfig
from elastictrain.core.prompts import BYTES, prompt_tokenizer

# Files that make a folder loadable by AutoTokenizer (a fast tokenizer, or a slow one's config).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def pop_eval_data(*raws: dict[str, Any]) -> dict[str, Any] | None:
    """Take `eval.data` out of the raw file and overrides (merged in order); None when none gives it.

    It is merged over `data` once that is known, so `eval.data.path=val.jsonl` alone keeps the
    training data's tokenizer, sequence length and packing.
    """
    given: dict[str, Any] | None = None
    for raw in raws:
        section = raw.get("eval")
        if isinstance(section, dict) and "data" in section:
            value = section.pop("data")
            if value is None:  # `eval.data: null` (as config.yaml writes it): no source of its own
                given = None
                continue
            merged = OmegaConf.merge(given or {}, value)
            given = OmegaConf.to_container(merged, resolve=False)  # type: ignore[assignment]
    return given


def set_eval_data(cfg: Any, given: dict[str, Any], problems: list[str]) -> None:
    """cfg.eval.data = cfg.data with `given` merged over it (a structured OmegaConf config)."""
    node = OmegaConf.structured(DataConfig)
    node = OmegaConf.merge(node, cfg.data)
    for key, value in given.items():
        try:
            OmegaConf.update(node, key, value, merge=True)
        except OmegaConfBaseException:
            problems.append(f"eval.data.{key}: got {value!r}; expected the type of data.{key}")
    cfg.eval.data = node


def eval_problems(config: Config, data_problems: Callable[[Config], list[str]]) -> list[str]:
    e, p = config.eval, []
    if e.every_steps < 0:
        p.append(f"eval.every_steps: got {e.every_steps}; expected >= 0 (0: only at the end of the run)")
    if e.steps < 0:
        p.append(f"eval.steps: got {e.steps}; expected >= 0 (global batches per evaluation; 0: none)")
    if not 0.0 <= e.split < 1.0:
        p.append(f"eval.split: got {e.split}; expected a fraction of the training data in [0, 1)")
    if e.split > 0 and e.data is not None:
        p.append(
            f"eval.split: got {e.split} and eval.data is set; expected one validation set: a held-out "
            "fraction of the training data (eval.split) or a source of its own (eval.data)"
        )
    if e.steps > 0 and e.split == 0 and e.data is None:
        p.append(
            f"eval.steps: got {e.steps} but no validation set; set eval.split (e.g. 0.05: held out from "
            "the training data) or eval.data (a source of its own, e.g. eval.data.path=val.jsonl)"
        )
    if e.data is not None:
        if e.data.seq_len != config.data.seq_len:
            p.append(
                f"eval.data.seq_len: got {e.data.seq_len}; expected data.seq_len ({config.data.seq_len}): "
                "validation batches are built like training ones"
            )
        own = data_problems(replace(config, data=e.data))
        p.extend(re.sub(r"\bdata\.", "eval.data.", line) for line in own)
    p.extend(prompts_problems(config))
    return p


def prompts_problems(config: Config) -> list[str]:
    """`eval.prompts` and what generating from them needs: a validation, a tokenizer, room to generate."""
    e, p = config.eval, []
    if e.max_new_tokens < 1:
        p.append(f"eval.max_new_tokens: got {e.max_new_tokens}; expected >= 1 (tokens generated per prompt)")
    prompts = e.prompts
    if prompts is None:
        return p
    if isinstance(prompts, bool) or not isinstance(prompts, int | list):
        return [
            *p,
            f"eval.prompts: got {prompts!r}; expected a list of prompt strings, or a number N (the prompt "
            "part of the validation set's first N records)",
        ]
    if isinstance(prompts, int) and prompts < 1:
        p.append(f"eval.prompts: got {prompts}; expected N >= 1 validation records (or null: no prompts)")
    if isinstance(prompts, list) and (not prompts or not all(isinstance(x, str) and x for x in prompts)):
        p.append(
            f"eval.prompts: got {prompts!r}; expected a non-empty list of non-empty strings (quote a prompt "
            "that YAML would read as a number)"
        )
    if not evaluates(config):
        p.append(
            "eval.prompts: set, but the run does not validate; completions are generated at each "
            "validation: set eval.steps (> 0) and eval.split or eval.data"
        )
    p.extend(_tokenizer_problems(config))
    positions = config.model.hf_config.get("max_position_embeddings")
    from_hf_config = not (config.model.factory or config.model.pretrained)
    if from_hf_config and isinstance(positions, int) and e.max_new_tokens >= positions:
        p.append(
            f"eval.max_new_tokens: got {e.max_new_tokens}; expected < the model's positions "
            f"(model.hf_config.max_position_embeddings: {positions}), leaving room for the prompt"
        )
    return p


def _tokenizer_problems(config: Config) -> list[str]:
    data = config.eval.data or config.data
    source = prompt_tokenizer(data, config.model.pretrained)
    field = "eval.data.tokenizer" if config.eval.data is not None else "data.tokenizer"
    if source is None:
        return [
            f"eval.prompts: no tokenizer to encode prompts and decode completions; set {field} (a local "
            "tokenizer folder) or use model.pretrained (a folder holding its tokenizer)"
        ]
    if source == BYTES or any((Path(source) / name).is_file() for name in _TOKENIZER_FILES):
        return []
    hint = f"; or set {field}" if not data.tokenizer else ""
    field = field if data.tokenizer else "model.pretrained"
    return [
        f"eval.prompts: {field} {source!r} holds no tokenizer ({' or '.join(_TOKENIZER_FILES)}); expected a "
        f"folder written by a tokenizer's save_pretrained{hint}"
    ]


def evaluates(config: Config) -> bool:
    """Whether the run validates: eval.steps > 0 and a validation set."""
    return config.eval.steps > 0 and (config.eval.split > 0 or config.eval.data is not None)
