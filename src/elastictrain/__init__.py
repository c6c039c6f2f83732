"""elastictrain: an elastic trainer for large models (Ray actors hosting DeepSpeed ZeRO-3 workers)."""

from __future__ import annotations

from typing import Any

from elastictrain.version import __version__ as __version__

__all__ = ["fit"]


def __getattr__(name: str) -> Any:
    # Imported on first use: `import elastictrain.core` must stay free of torch, ray and mlflow.
    if name == "fit":
        from elastictrain.driver.api import fit

        return fit
    raise AttributeError(f"module 'elastictrain' has no attribute {name!r}")
