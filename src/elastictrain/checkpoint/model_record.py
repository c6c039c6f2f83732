"""What a checkpoint records about its model, so that `export`, `eval`, `reshard` and `resume` need
nothing but the checkpoint to know which model its fragments belong to.

A manifest's "model" holds two parts:
- what the config says (written by the driver): the source (`hf_config`, `pretrained` or `factory`),
  `model.hf_config` as configured, the pretrained folder and the tokenizer folder as absolute paths,
  the training precision;
- "built": what rank 0 reports from the model it built (worker/actor.py): its transformers config,
  class, generation config, and peft's LoRA config. Rank 0 reports it, rather than the driver
  computing it, because only the built model knows: a `model.factory` runs only on the workers
  (inside zero.Init, possibly needing a GPU), `from_pretrained` and peft fill in values of their own,
  and the same code then covers all three sources.

Manifests written before this record hold only "hf_config": they are read as a model built from it.
Nothing here imports torch or transformers at module level (control/ imports this).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Files any of transformers' tokenizers is saved as; a folder holding one of them has a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Config keys that say how a model was loaded or run, not what it is: never a reason to refuse a resume.
NOT_IDENTITY = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "architectures", "use_cache"}


def configured_model(config: Any) -> dict[str, Any]:
    """The driver's part of the record: the model as the config describes it."""
    m = config.model
    source = "factory" if m.factory else "pretrained" if m.pretrained else "hf_config"
    pretrained = str(Path(m.pretrained).resolve()) if m.pretrained else None
    return {
        "source": source,
        "hf_config": dict(m.hf_config),
        "pretrained": pretrained,
        "factory": m.factory,
        "tokenizer": tokenizer_folder(config.data.tokenizer, pretrained),
        "precision": config.training.precision,
    }


def tokenizer_folder(data_tokenizer: str | None, pretrained: str | None) -> str | None:
    """The tokenizer an export carries: `data.tokenizer`, else the pretrained folder's own (if any)."""
    if data_tokenizer:
        return str(Path(data_tokenizer).resolve())
    if pretrained and any((Path(pretrained) / name).is_file() for name in TOKENIZER_FILES):
        return pretrained
    return None


def built_model(model: Any, *, activation_checkpointing: bool = False) -> dict[str, Any]:
    """The worker's part of the record, from the model it built (a peft model is looked through)."""
    peft = None
    base = model
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        peft = _plain(model.peft_config["default"].to_dict())
        base = model.get_base_model()
    hf = getattr(base, "config", None)
    if not hasattr(hf, "to_dict") or not hasattr(base, "save_pretrained"):
        return {"config": None, "architecture": type(base).__name__, "generation_config": None, "peft": peft}
    config = _plain(hf.to_dict())
    config.pop("_name_or_path", None)  # where it was loaded from, not what it is
    if activation_checkpointing:
        config.pop("use_cache", None)  # turned off for training only: the export gets the class default
    generation = getattr(base, "generation_config", None)
    can_generate = getattr(base, "can_generate", lambda: False)()
    return {
        "config": config,
        "architecture": type(base).__name__,
        "generation_config": _plain(generation.to_diff_dict()) if generation and can_generate else None,
        "peft": peft,
    }


def _plain(value: dict[str, Any]) -> dict[str, Any]:
    """JSON's types only (peft keeps sets and enums): the same record in a manifest and in memory."""

    def default(o: Any) -> Any:
        if isinstance(o, (set, frozenset)):
            return sorted(o)
        if isinstance(o, enum.Enum):
            return o.value
        return str(o)

    return dict(json.loads(json.dumps(value, default=default)))


@dataclass(frozen=True)
class ModelRecord:
    """A checkpoint's model, as its manifest records it (see the module's docstring)."""

    source: str  # hf_config | pretrained | factory
    hf_config: dict[str, Any]
    config: dict[str, Any] | None  # the built model's transformers config; None: not a transformers model
    architecture: str | None  # the built model's class name
    generation_config: dict[str, Any] | None
    peft: dict[str, Any] | None  # peft's LoRA config; None: no LoRA
    pretrained: str | None
    tokenizer: str | None
    precision: str
    recorded: bool  # False: an older manifest (or a worker that did not report); the rest is inferred

    @property
    def is_transformers(self) -> bool:
        return self.config is not None


def model_record(manifest: dict[str, Any]) -> ModelRecord:
    """The record of `manifest`; an older one (only "hf_config") reads as a model built from it."""
    saved = dict(manifest.get("model") or {})
    hf_config = dict(saved.get("hf_config") or {})
    source = str(saved.get("source") or "hf_config")
    built = saved.get("built")
    pretrained = saved.get("pretrained")
    if isinstance(built, dict):
        config, architecture = built.get("config"), built.get("architecture")
        generation, peft = built.get("generation_config"), built.get("peft")
    else:  # not reported: what the config alone says
        config = _config_without_build(source, hf_config, pretrained)
        architecture = generation = peft = None
    return ModelRecord(
        source=source,
        hf_config=hf_config,
        config=config,
        architecture=architecture,
        generation_config=generation,
        peft=peft,
        pretrained=pretrained,
        tokenizer=saved.get("tokenizer"),
        precision=str(saved.get("precision") or "fp32"),
        recorded=isinstance(built, dict),
    )


def _config_without_build(source: str, hf_config: dict[str, Any], pretrained: str | None) -> dict | None:
    if source == "hf_config" and "model_type" in hf_config:
        return dict(hf_config)
    if source == "pretrained" and pretrained and (Path(pretrained) / "config.json").is_file():
        from transformers import AutoConfig

        return _plain(AutoConfig.from_pretrained(pretrained, local_files_only=True).to_dict())
    return None


def transformers_config(record: ModelRecord) -> Any:
    """The record's transformers config object (`record.config` must be set)."""
    from transformers import AutoConfig

    assert record.config is not None, "not a transformers model"
    params = dict(record.config)
    params.pop("transformers_version", None)  # save_pretrained writes the version that writes it
    return AutoConfig.for_model(params.pop("model_type"), **params)


def model_mismatch(manifest: dict[str, Any], configured: dict[str, Any]) -> list[str]:
    """How the model a checkpoint was saved from differs from the configured one (empty: same model).

    `configured` is configured_model(config). Only what the driver knows without building the model is
    compared; the load itself checks every parameter's shape.
    """
    saved = manifest.get("model") or {}
    if not isinstance(saved.get("hf_config"), dict):
        return []  # an older manifest without the model
    record = model_record(manifest)
    source = configured.get("source", "hf_config")
    if "source" in saved and record.source != source:
        return [
            f"model: the checkpoint's model was built from model.{record.source}, "
            f"the config's is built from model.{source}"
        ]
    if source == "hf_config":
        return _differences("model.hf_config", record.hf_config, dict(configured.get("hf_config") or {}))
    if source == "pretrained" and record.recorded and record.config and configured.get("pretrained"):
        now = _config_without_build("pretrained", {}, configured["pretrained"])
        if now is not None:
            # Only what both say, less how the model was loaded: the folder may have moved or been resaved.
            common = {
                k for k in set(record.config) & set(now) if k not in NOT_IDENTITY and not k.startswith("_")
            }
            where = f"model.pretrained ({configured['pretrained']}/config.json)"
            return _differences(where, {k: record.config[k] for k in common}, {k: now[k] for k in common})
    return []


def _differences(where: str, saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    keys = sorted(set(saved) | set(now))
    return [
        f"{where}.{k}: checkpoint has {saved.get(k)!r}, config has {now.get(k)!r}"
        for k in keys
        if saved.get(k) != now.get(k)
    ]
