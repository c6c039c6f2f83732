"""The model's transformers config built on the driver, before any worker starts (no weights loaded).

What transformers itself would reject inside every worker (a hidden size that the heads do not
divide, a wrong type, an unknown model type) becomes a config error naming the field here; so do a
misspelt key of `model.hf_config` (transformers stores it silently), a `data.seq_len` beyond the
model's positions (also for `model.pretrained`, read from its config.json) and a tokenizer with more
tokens than the model's embedding has rows.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import types
from typing import Any


def _innermost(e: BaseException) -> BaseException:
    while e.__cause__ is not None:
        e = e.__cause__
    return e


def _one_line(e: BaseException) -> str:
    inner = _innermost(e)
    text = " ".join(str(inner).split())
    return text if isinstance(inner, ValueError) and text else f"{type(inner).__name__}: {text}"


def known_fields(cls: type) -> set[str]:
    """Every key a transformers config class takes: fields, __init__ parameters, aliases, properties."""
    from transformers import PretrainedConfig

    names: set[str] = set()
    for klass in (cls, PretrainedConfig):
        if dataclasses.is_dataclass(klass):
            names |= {f.name for f in dataclasses.fields(klass)}
        names |= set(inspect.signature(klass.__init__).parameters)
        names |= set(getattr(klass, "attribute_map", {}) or {})
        names |= {n for n in dir(klass) if isinstance(inspect.getattr_static(klass, n, None), property)}
    return {n for n in names if not n.startswith("_")} - {"self", "args", "kwargs"}


def unknown_keys(hf_config: dict[str, Any], built: Any) -> list[str]:
    """Keys transformers kept as plain attributes because its config class has no such field."""
    fields = known_fields(type(built))
    stored = set(vars(built))
    problems = []
    for key in sorted(k for k in hf_config if k != "model_type"):
        if key in fields or key not in stored:  # a field, or a legacy key transformers took in
            continue
        close = difflib.get_close_matches(key, sorted(fields), n=1)
        hint = f"did you mean '{close[0]}'?" if close else "it is not a field of that config class"
        problems.append(
            f"model.hf_config.{key}: not a setting of {type(built).__name__} "
            f"(model_type {hf_config.get('model_type')!r}), so transformers would ignore it; {hint}"
        )
    return problems


def _build(config: Any) -> tuple[Any, list[str]]:
    """The transformers config of `config.model` (None when a factory builds the model), or problems."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    m = config.model
    if m.factory:
        return None, []
    if m.pretrained:
        try:
            return AutoConfig.from_pretrained(m.pretrained, local_files_only=True), []
        except Exception as e:  # noqa: BLE001 - transformers raises many types for a bad config.json
            return None, [f"model.pretrained: {m.pretrained}/config.json does not load: {_one_line(e)}"]
    params = dict(m.hf_config)
    model_type = params.pop("model_type")
    if model_type not in CONFIG_MAPPING:
        close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING.keys()), n=1)
        hint = (
            f"did you mean '{close[0]}'?" if close else "expected a transformers model type such as 'llama'"
        )
        return None, [
            f"model.hf_config.model_type: got {model_type!r}; not a transformers model type; {hint}"
        ]
    try:
        built = AutoConfig.for_model(model_type, **params)
    except Exception as e:  # noqa: BLE001 - validation errors of the config class, of many types
        return None, [f"model.hf_config: transformers rejects it ({model_type}): {_one_line(e)}"]
    return built, unknown_keys(dict(m.hf_config), built)


def _structure_problem(built: Any) -> str | None:
    """Build the model on the meta device (no memory): what its constructor rejects is found here."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    # A ZeRO-3 model load earlier in this process (a `--local` run's worker) leaves transformers building
    # every model under zero.Init, which cannot partition meta tensors ("Cannot copy out of meta tensor").
    unset_hf_deepspeed_config()
    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(built)
    except Exception as e:  # noqa: BLE001 - whatever the model's constructor raises
        return f"model.hf_config: transformers cannot build a causal LM from it: {_one_line(e)}"
    return None


def _seq_len_problem(config: Any, built: Any) -> str | None:
    positions = getattr(built, "max_position_embeddings", None)
    seq_len = config.data.seq_len
    if not isinstance(positions, int) or seq_len <= positions:
        return None
    if config.model.pretrained:
        where = f"max_position_embeddings of model.pretrained {config.model.pretrained!r} (its config.json)"
    else:
        where = f"model.hf_config.max_position_embeddings (transformers' value for {built.model_type})"
    return f"data.seq_len: got {seq_len}; expected <= {positions}, the {where}"


def vocab_problem(config: Any, vocab: int | None, field: str) -> str | None:
    """A `data.tokenizer` with more tokens than the model's embedding has rows (`field` names that)."""
    d = config.data
    if d.source == "tokens" and d.path and isinstance(vocab, int):
        from elastictrain.data.token_index import vocab_of

        used = vocab_of(d.path)
        if used is None or used <= vocab:
            return None
        return (
            f"data.path: the shards in {d.path!r} were tokenized with a vocabulary of {used} tokens "
            f"(its index.json), more than the model's {field} ({vocab}); token ids {vocab} and up would "
            f"index past the embedding. Expected a model with vocab_size >= {used}"
        )
    if d.source not in ("hf", "sft") or not d.tokenizer or not isinstance(vocab, int):
        return None
    from elastictrain.data.hf_files import load_tokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        tokens = len(load_tokenizer(d.tokenizer))
    except ValueError:
        return None  # reported with the data checks (check_hf_data)
    if tokens <= vocab:
        return None
    return (
        f"data.tokenizer: {d.tokenizer!r} has {tokens} tokens, more than the model's {field} ({vocab}); "
        f"token ids {vocab} and up would index past the embedding. Expected a tokenizer of at most {vocab} "
        f"tokens, or a model with vocab_size >= {tokens}"
    )


def model_problems(config: Any) -> list[str]:
    """Everything about `config.model` checkable without weights, one line per problem."""
    from elastictrain.config import model_facts

    hf_config, facts = model_facts.recall(config)
    built: Any
    structure: str | None = None
    if "model_type" in facts:  # this config built before, with these releases: no torch, no transformers
        built = types.SimpleNamespace(**{k: facts[k] for k in model_facts.CONFIG_FACTS})
    else:
        built, problems = _build(config)
        if built is None or problems:
            return problems
        structure = None if config.model.pretrained else _structure_problem(built)
        if hf_config is not None and structure is None:
            model_facts.remember(hf_config, **model_facts.config_facts(built))
    problems = []
    for found in (
        structure,
        _seq_len_problem(config, built),
        vocab_problem(
            config,
            getattr(built, "vocab_size", None),
            "model.pretrained's vocab_size" if config.model.pretrained else "model.hf_config.vocab_size",
        ),
    ):
        if found:
            problems.append(found)
    return problems
