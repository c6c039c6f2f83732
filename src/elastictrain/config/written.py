"""The resolved config as it leaves the program: YAML for config.yaml, flat params for MLflow, a digest
naming the run. Secrets are masked in all three (redact.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from omegaconf import OmegaConf

from elastictrain.config.schema import Config
from elastictrain.redact import redact


def to_yaml(config: Config) -> str:
    """The resolved config as written to config.yaml and MLflow: secrets masked (redact.py)."""
    return OmegaConf.to_yaml(OmegaConf.create(redact(dataclasses.asdict(config))))


def to_printed_yaml(config: Config) -> str:
    """`--print-config`'s YAML: to_yaml without the placeholders a run computes at start (max_steps from
    num_epochs, warmup_steps from warmup_ratio), so that the printed config loads as the same config."""
    data = redact(dataclasses.asdict(config))
    training = data["training"]
    if training["num_epochs"] is not None and training["epoch_samples"] is None:
        del training["max_steps"]
    if training["warmup_ratio"] is not None:
        del training["warmup_steps"]
    return OmegaConf.to_yaml(OmegaConf.create(data))


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(value, list):
        out[prefix] = json.dumps(value)
    else:
        out[prefix] = value


def to_flat_dict(config: Config) -> dict[str, Any]:
    out: dict[str, Any] = {}
    _flatten(redact(dataclasses.asdict(config)), "", out)  # these become MLflow params: no secrets
    return out


def config_digest(config: Config) -> str:
    # Of the masked config, so that the run's own config.yaml (masked) names the same run.
    canonical = json.dumps(redact(dataclasses.asdict(config)), sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()
