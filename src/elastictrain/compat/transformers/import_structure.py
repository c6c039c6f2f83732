"""transformers' import structure of its model folders, kept on disk between processes."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import pickle
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from elastictrain.compat.registry import installed_version, patch
from elastictrain.user_cache import cache_folder, save_whole

_MODULE = "transformers.utils.import_utils"
_installed: list[bool] = []


def _check() -> str | None:
    """The shape, read from the source: importing transformers to look would scan its models first."""
    spec = importlib.util.find_spec("transformers")
    folders = list(spec.submodule_search_locations or []) if spec else []
    if not folders:
        return "transformers is not installed as a package"
    source = Path(folders[0]) / "utils" / "import_utils.py"
    try:
        text = source.read_text(encoding="utf-8")
    except OSError as e:
        return f"cannot read {source}: {e}"
    for name in ("create_import_structure_from_path", "define_import_structure"):
        if f"\ndef {name}(" not in text:
            return f"{_MODULE} has no {name}"
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
    at each call, so `define_import_structure` calls the wrapper): for the models folder (the scan that
    `import transformers` itself runs) and for a package's `__init__.py` inside the installed
    transformers it answers from `~/.cache/elastictrain/transformers-<version>-import-structure.pkl`,
    computing and adding what is missing. Subfolders (the scan's own recursion) and paths outside
    transformers go to the original. Called before transformers is imported, it wraps the module as soon
    as it has run (an import hook for that one module), so the first scan is answered too; called after,
    it wraps it at once. A development release (`.dev` in its version) is never cached, since its
    sources change under one version. Every process calls it first: the CLI, each worker, the tests.
    Why: `import transformers` reads the source of every model file for its `__all__`: about 1 CPU s
    of its 3-4 s on 2 cores (with a model's config), in every worker, every replacement and every
    command.
    Retired by: transformers shipping its import structure precomputed, or caching it itself; no
    upstream issue found.
    """
    if _installed:
        return
    _installed.append(True)
    loaded = sys.modules.get(_MODULE)
    if loaded is not None:  # transformers is imported: the models folder was scanned, its packages not yet
        _wrap(loaded)
    else:
        sys.meta_path.insert(0, _WrapWhenLoaded())


class _WrapWhenLoaded(importlib.abc.MetaPathFinder):
    """Finds transformers.utils.import_utils as the path finder does, and wraps it once it has run,
    before `transformers/__init__.py` goes on to scan the models folder."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run_module = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            _wrap(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _wrap(import_utils: ModuleType) -> None:
    version = installed_version("transformers") or ""
    original = getattr(import_utils, "create_import_structure_from_path", None)
    if ".dev" in version or not callable(original):
        return
    root = Path(import_utils.__file__ or "").resolve().parents[1]
    models = root / "models"
    store = cache_folder() / f"transformers-{version}-import-structure.pkl"
    stamp = (str(root), models.stat().st_mtime_ns)  # a model folder added or removed: anew
    cache = _read(store, stamp)

    def cached(module_path: Any) -> Any:
        path = Path(module_path)
        # The models folder (its whole scan) and each package's __init__.py under transformers; the
        # scan's own recursion into subfolders goes to the original.
        if path.name == "__init__.py":
            path = path.resolve()
            if root not in path.parents:
                return original(module_path)
        elif path.resolve() == models:
            path = models
        else:
            return original(module_path)
        key = str(path)
        if key not in cache:
            cache[key] = original(module_path)
            _write(store, stamp, {**_read(store, stamp), **cache})
        return cache[key]

    cached.original = original  # type: ignore[attr-defined]
    import_utils.create_import_structure_from_path = cached


def _read(store: Path, stamp: tuple[str, int]) -> dict[str, Any]:
    try:
        with store.open("rb") as f:
            found = pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ValueError):
        return {}
    return dict(found["structures"]) if isinstance(found, dict) and found.get("stamp") == stamp else {}


def _write(store: Path, stamp: tuple[str, int], structures: dict[str, Any]) -> None:
    save_whole(store, pickle.dumps({"stamp": stamp, "structures": structures}))
