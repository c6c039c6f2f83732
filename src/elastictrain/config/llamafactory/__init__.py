"""LLaMA-Factory's YAML files, read with LLaMA-Factory's meaning: training files become elastictrain configs
(translate.py, by the table in keys.py and templates.py), merge files become exports (export_file.py)."""

from elastictrain.config.llamafactory.translate import Translation, is_llamafactory, translate

__all__ = ["Translation", "is_llamafactory", "translate"]
