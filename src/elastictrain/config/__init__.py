"""Configuration: OmegaConf YAML + dotlist overrides -> typed, validated dataclasses."""

from elastictrain.config.errors import ConfigError
from elastictrain.config.loader import load_config
from elastictrain.config.schema import Config
from elastictrain.config.validate import valid_world_sizes, validate
from elastictrain.config.written import config_digest, to_flat_dict, to_printed_yaml, to_yaml

__all__ = [
    "Config",
    "ConfigError",
    "config_digest",
    "load_config",
    "to_flat_dict",
    "to_printed_yaml",
    "to_yaml",
    "valid_world_sizes",
    "validate",
]
