"""Load a config: schema defaults, then the YAML file, then `key=value` overrides.

Unknown keys and values of the wrong type are reported at once, one line each, naming the full dotted
field, the bad value and what would be valid; config/validate.py then checks the values together.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from elastictrain.config.errors import ConfigError
from elastictrain.config.eval_check import pop_eval_data, set_eval_data
from elastictrain.config.length import layer_length
from elastictrain.config.llamafactory import is_llamafactory, translate
from elastictrain.config.schema import Config, DataConfig
from elastictrain.config.validate import validate
from elastictrain.redact import install_log_redaction
from elastictrain.storage import as_path

log = logging.getLogger("elastictrain.config")
install_log_redaction()  # secrets given in the config or environment never reach a log line

# Mapping-typed fields hold free-form content (a transformers config, raw DeepSpeed keys, user args).
FREE_FORM = {"model.hf_config", "deepspeed.extra", "model.args", "data.args"}


def _type_words(tp: Any) -> str:
    if typing.get_origin(tp) is list:
        return "a list"
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if args:
        return _type_words(args[0]) + " or null"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, "a mapping")


def _schema_fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _check_keys(raw: Any, cls: type, prefix: str, problems: list[str]) -> None:
    if not isinstance(raw, dict):
        if prefix:
            problems.append(f"{prefix}: got {raw!r}; expected a mapping of {', '.join(_schema_fields(cls))}")
        return
    fields = _schema_fields(cls)
    for key, value in raw.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = (
                f"did you mean '{prefix + '.' if prefix else ''}{close[0]}'?"
                if close
                else (f"valid keys{' of ' + prefix if prefix else ''}: {', '.join(fields)}")
            )
            problems.append(f"unknown key '{path}'; {hint}")
        elif dataclasses.is_dataclass(fields[key]) and path not in FREE_FORM:
            _check_keys(value, fields[key], path, problems)


def _leaves(raw: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(raw, dict) and prefix not in FREE_FORM:
        out: list[tuple[str, Any]] = []
        for k, v in raw.items():
            out.extend(_leaves(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return [(prefix, raw)]


def _field_type(path: str) -> Any:
    cls: Any = Config
    tp: Any = Config
    for part in path.split("."):
        tp = _schema_fields(cls).get(part)
        if dataclasses.is_dataclass(tp):
            cls = tp
    return tp


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """Schema defaults, then the YAML file, then `key=value` overrides; validated."""
    problems: list[str] = []
    raw_file: dict[str, Any] = {}
    if path is not None:
        p = as_path(path)  # a run folder's config.yaml may be on an object store
        if p.is_dir():
            raise ConfigError(
                [f"config file {p}: is a directory; expected a YAML file such as conf/tiny-cpu.yaml"]
            )
        try:
            source = OmegaConf.load(p) if isinstance(p, Path) else OmegaConf.create(p.read_text())
            loaded = OmegaConf.to_container(source, resolve=False)
        except FileNotFoundError:
            raise ConfigError([f"config file {p}: does not exist"]) from None
        except Exception as e:  # noqa: BLE001 - YAML syntax errors come in many types
            raise ConfigError([f"config file {p}: not valid YAML ({e})"]) from None
        if not loaded:  # an empty file (or only comments, or {})
            log.warning(
                "config file %s is empty: using the built-in defaults (those of conf/tiny-cpu.yaml)", p
            )
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError([f"config file {p}: expected a mapping of sections at the top level"])
        raw_file = loaded
    if is_llamafactory(raw_file):  # its own keys and defaults, as LLaMA-Factory reads them
        lf = translate(raw_file, overrides)
        if lf.problems:
            raise ConfigError([f"LLaMA-Factory file {path}: {line}" for line in lf.problems])
        for line in lf.notices:
            log.warning("LLaMA-Factory file: %s", line)
        raw_file, overrides = lf.native, lf.overrides
    raw_overrides: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            problems.append(f"override {item!r}: expected key=value, e.g. training.max_steps=100")
            continue
        try:
            raw_overrides = OmegaConf.to_container(
                OmegaConf.merge(raw_overrides, OmegaConf.from_dotlist([item])), resolve=False
            )  # type: ignore[assignment]
        except OmegaConfBaseException as e:
            problems.append(f"override {item!r}: {e}")
    _check_keys(raw_file, Config, "", problems)
    _check_keys(raw_overrides, Config, "", problems)
    eval_data = pop_eval_data(raw_file, raw_overrides)  # merged over `data` below
    if eval_data is not None:
        _check_keys(eval_data, DataConfig, "eval.data", problems)
    unknown = {line.split("'")[1] for line in problems if line.startswith("unknown key")}

    cfg = OmegaConf.structured(Config)
    # A model.hf_config given in full replaces the default model instead of merging into it.
    if isinstance(raw_file.get("model"), dict) and "hf_config" in raw_file["model"]:
        cfg.model.hf_config = {}
    for source in (raw_file, raw_overrides):
        for key, value in _leaves(source):
            if any(key == u or key.startswith(u + ".") for u in unknown):
                continue
            try:
                OmegaConf.update(cfg, key, value, merge=True)
            except OmegaConfBaseException:
                problems.append(f"{key}: got {value!r}; expected {_type_words(_field_type(key))}")
    layer_length(cfg, raw_file, raw_overrides, problems)
    if eval_data is not None:
        set_eval_data(cfg, {k: v for k, v in eval_data.items() if k in _schema_fields(DataConfig)}, problems)
    if problems:
        raise ConfigError(problems)
    try:
        config: Config = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    except OmegaConfBaseException as e:
        raise ConfigError([f"{getattr(e, 'full_key', '') or 'config'}: {getattr(e, 'msg', e)}"]) from None
    return validate(config)
