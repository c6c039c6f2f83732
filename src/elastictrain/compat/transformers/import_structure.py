"""transformers' import structure of its model folders, kept on disk between processes."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path
from typing import Any

from elastictrain.compat.registry import installed_version, patch
from elastictrain.user_cache import cache_folder, save_whole

_installed: list[bool] = []


def _check() -> str | None:
    from transformers.utils import import_utils

    if not callable(getattr(import_utils, "create_import_structure_from_path", None)):
        return "transformers.utils.import_utils has no create_import_structure_from_path"
    if not callable(getattr(import_utils, "define_import_structure", None)):
        return "transformers.utils.import_utils has no define_import_structure"
    return None


def _leave_it_to_transformers() -> None:
    return None


@patch(
    "transformers_import_structure_cached",
    package="transformers",
    tested=">=5.24,<5.25",
    kind="performance",
    check=_check,
    otherwise=_leave_it_to_transformers,
)
def cache_import_structure() -> None:
    """Keep the import structures transformers computes for its own packages in a file, so that a new
    process reads them instead of scanning every model folder's source again.

    What: wraps `transformers.utils.import_utils.create_import_structure_from_path` (looked up by name
    at each call, so `define_import_structure` calls the wrapper): for a package's `__init__.py` inside
    the installed transformers it answers from `~/.cache/elastictrain/transformers-<version>-import-
    structure.pkl`, computing and adding what is missing. Folders (the scan's own recursion) and paths
    outside transformers go to the original. A development release (`.dev` in its version) is never
    cached, since its sources change under one version. Call it before `transformers.models` is imported.
    Why: the first `import transformers.models` reads the source of every model file for its `__all__`
    (about 0.25 CPU s of a process's 2.2 s transformers import on 2 cores), in every worker, every
    replacement and every command that builds a model.
    Retired by: transformers shipping its import structure precomputed, or caching it itself; no
    upstream issue found.
    """
    if _installed or "transformers.models" in sys.modules:
        return
    import transformers
    from transformers.utils import import_utils

    version = installed_version("transformers") or ""
    if ".dev" in version:
        return
    root = Path(transformers.__file__).resolve().parent
    store = cache_folder() / f"transformers-{version}-import-structure.pkl"
    stamp = (str(root), (root / "models").stat().st_mtime_ns)  # a model folder added or removed: anew
    original = import_utils.create_import_structure_from_path
    cache = _read(store, stamp)

    def cached(module_path: str) -> Any:
        path = Path(module_path)
        if path.name != "__init__.py" or root not in path.resolve().parents:
            return original(module_path)
        key = str(path.resolve())
        if key not in cache:
            cache[key] = original(module_path)
            _write(store, stamp, {**_read(store, stamp), **cache})
        return cache[key]

    import_utils.create_import_structure_from_path = cached
    _installed.append(True)


def _read(store: Path, stamp: tuple[str, int]) -> dict[str, Any]:
    try:
        with store.open("rb") as f:
            found = pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ValueError):
        return {}
    return dict(found["structures"]) if isinstance(found, dict) and found.get("stamp") == stamp else {}


def _write(store: Path, stamp: tuple[str, int], structures: dict[str, Any]) -> None:
    save_whole(store, pickle.dumps({"stamp": stamp, "structures": structures}))
