"""The folder where elastictrain keeps what it computes once per installed release of a package."""

from __future__ import annotations

import os
from pathlib import Path


def cache_folder() -> Path:
    """`$XDG_CACHE_HOME/elastictrain`, else `~/.cache/elastictrain`."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "elastictrain"
