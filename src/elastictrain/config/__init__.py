"""Configuration: OmegaConf YAML + dotlist overrides -> typed, validated dataclasses."""

from elastictrain.config.errors import ConfigError
from elastictrain.config.loader import (
    config_digest,
    load_config,
    to_flat_dict,
    to_yaml,
    valid_world_sizes,
    validate,
)
from elastictrain.config.schema import Config

__all__ = [
    "Config",
    "ConfigError",
    "config_digest",
    "load_config",
    "to_flat_dict",
    "to_yaml",
    "valid_world_sizes",
    "validate",
]
