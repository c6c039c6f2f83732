"""What the driver learns by building a `model.hf_config` model empty, remembered per machine.

Before any worker starts, the driver builds the model's transformers config and the model itself on the
meta device (config/model_check.py: what transformers would reject), then again without weights for
its memory estimate (preflight.model_parts). Importing torch and transformers' modeling code for that
costs a driver seconds of CPU at every `train` and `resume`, though the answer depends only on the
`model.hf_config` and the installed transformers and torch. The first driver that builds a
config saves what the later checks read (its positions, vocabulary and parameter sizes) under the
cache folder; a driver that finds them imports neither.

Only a config that built is remembered: one that transformers rejects is built (and its error
reported) every time. `model.pretrained` and `model.factory` models are always built.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from typing import Any

from elastictrain.user_cache import cache_folder, save_whole

FORMAT = 1  # raise when what a record holds changes: older records are then not found
PACKAGES = ("transformers", "torch")


def plain_hf_config(config: Any) -> dict[str, Any] | None:
    """`model.hf_config` where it alone defines the model (no pretrained, no factory), else None."""
    m = config.model
    if m.factory or m.pretrained or not m.hf_config:
        return None
    return dict(m.hf_config)


def recall(config: Any) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(`plain_hf_config(config)`, what earlier drivers saved for it: {} when nothing or not plain)."""
    hf_config = plain_hf_config(config)
    return hf_config, remembered(hf_config) if hf_config is not None else {}


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _path(hf_config: dict[str, Any]) -> Any:
    what = {"format": FORMAT, "hf_config": hf_config, **{p: _version(p) for p in PACKAGES}}
    key = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return cache_folder() / "model-facts" / f"{key}.json"


def remembered(hf_config: dict[str, Any]) -> dict[str, Any]:
    """What earlier drivers saved for this config with these releases ({} when nothing)."""
    try:
        found = json.loads(_path(hf_config).read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def remember(hf_config: dict[str, Any], **facts: Any) -> None:
    """Add `facts` to this config's record (unsaved where the cache folder is not writable: the next
    driver builds the model again)."""
    record = {**remembered(hf_config), **facts}
    save_whole(_path(hf_config), json.dumps(record, sort_keys=True).encode())


CONFIG_FACTS = ("model_type", "max_position_embeddings", "vocab_size")


def config_facts(built: Any) -> dict[str, Any]:
    """What the checks after the build read from the transformers config."""
    return {name: getattr(built, name, None) for name in CONFIG_FACTS}
