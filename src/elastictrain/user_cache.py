"""The folder where elastictrain keeps what a machine computes once (per installed release of a package,
per CPU, per object-store run), and how a file there is written."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def cache_folder() -> Path:
    """`$ELASTICTRAIN_CACHE`, else `~/.cache/elastictrain`."""
    return Path(os.environ.get("ELASTICTRAIN_CACHE", "~/.cache/elastictrain")).expanduser()


def save_whole(path: Path, data: bytes) -> bool:
    """Write `data` to `path` whole or not at all (a temporary file beside it, then a rename), so that a
    process reading it meanwhile, or writing it too, sees one whole file. False where it could not: the
    cache stays unsaved and the next process computes it again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    except OSError:
        return False
    return True
