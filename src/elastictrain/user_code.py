"""Your code in a run: import paths named in the config, or Python objects handed to `elastictrain.fit`.

Four config fields name user code, each "module:attr" (resolved in every worker process):
`model.factory`, `data.factory`, `data.collate` and `training.loss`. `elastictrain.fit` also takes the
objects themselves; it records each one's import path in the config when it has one, and otherwise a
label such as '<__main__.build_model>', and carries the object to the workers by value (Ray
cloudpickles it). Either way the run's config.yaml says which code trained it.

`elastictrain.driver.preflight.check_user_code` tries all of it on the driver before any actor starts.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

FIELDS = ("model.factory", "data.factory", "data.collate", "training.loss")
_ATTACHED = "_elastictrain_user_objects"  # a plain attribute of the Config instance: pickled with it


class UserCodeError(ValueError):
    """User code named in the config cannot be used; the message names the field."""


# -- carrying Python objects with the config ------------------------------------------------------------
def attach(config: Any, objects: dict[str, Any]) -> None:
    """Let `objects` (field -> object given to fit) travel with `config` to every worker."""
    unknown = set(objects) - set(FIELDS)
    if unknown:
        raise ValueError(f"user code fields: got {sorted(unknown)}; expected some of {', '.join(FIELDS)}")
    object.__setattr__(config, _ATTACHED, dict(objects))


def attached(config: Any) -> dict[str, Any]:
    return dict(getattr(config, _ATTACHED, {}))


def label_for(obj: Any) -> str:
    """The config value recorded for an object given to fit(): its import path when it has one."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str):
        path = f"{module}:{qualname}"
        if module != "__main__" and "<" not in qualname:
            try:
                if import_path("", path) is obj:
                    return path
            except UserCodeError:
                pass
        return f"<{module}.{qualname}>"
    kind = type(obj)
    return f"<{kind.__module__}.{kind.__qualname__} object>"


# -- resolving ----------------------------------------------------------------------------------------
def import_path(field: str, value: str) -> Any:
    """The object at "module:attr" (attr may be dotted, e.g. "pkg.mod:Class.build")."""
    module_name, _, attr = value.partition(":")
    where = f"{field}: {value!r}" if field else repr(value)
    if not module_name or not attr:
        raise UserCodeError(f"{where}: expected an import path 'module:attr', e.g. 'mypkg.models:build'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any error while importing user code is reported the same way
        raise UserCodeError(f"{where} does not import: {e}") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise UserCodeError(
                f"{where} does not resolve: module {module_name!r} has no attribute {attr!r}"
            ) from None
    return obj


def _field_value(config: Any, field: str) -> str | None:
    section, name = field.split(".")
    return getattr(getattr(config, section), name)


def resolve(config: Any, field: str) -> Any | None:
    """The object a user-code field names: the one given to fit(), else the import path's target."""
    value = _field_value(config, field)
    if value is None:
        return None
    objects = attached(config)
    if field in objects:
        return objects[field]
    if value.startswith("<"):
        raise UserCodeError(
            f"{field}: {value!r} was a Python object given to elastictrain.fit() and is not available "
            "here; call elastictrain.fit(...) with it again, or name it in the config as an import path "
            "'module:attr'"
        )
    return import_path(field, value)


def call_factory(field: str, factory: Any, config: Any) -> Any:
    """Call a factory with the run's config when it takes a required positional argument, else with none."""
    if not callable(factory):
        raise UserCodeError(f"{field}: got {_describe(factory)}; expected a callable (a function or class)")
    return factory(config) if _wants_config(factory) else factory()


def _wants_config(fn: Callable[..., Any]) -> bool:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # some builtins have no signature: assume the documented form
        return True
    for p in params:
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            return True
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty:
            return True
    return False


def _describe(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__} object"


# -- building ------------------------------------------------------------------------------------------
def user_model(config: Any) -> Any:
    """The torch.nn.Module of `model.factory` (built in the caller's context: e.g. inside zero.Init)."""
    import copy

    import torch

    made = resolve(config, "model.factory")
    if isinstance(made, torch.nn.Module):
        # A module given by value: each attempt trains a fresh copy (DeepSpeed changes the one it gets).
        return copy.deepcopy(made)
    model = call_factory("model.factory", made, config)
    if not isinstance(model, torch.nn.Module):
        raise UserCodeError(
            f"model.factory: {config.model.factory!r} returned {_describe(model)}; expected a torch.nn.Module"
        )
    return model


def user_dataset(config: Any) -> Any:
    """The map-style dataset of `data.factory`, checked for a length and item access."""
    made = resolve(config, "data.factory")
    is_factory = inspect.isclass(made) or (callable(made) and not _is_map_style(made))
    dataset = call_factory("data.factory", made, config) if is_factory else made
    check_dataset("data.factory", config.data.factory, dataset)
    return dataset


def _is_map_style(obj: Any) -> bool:
    return hasattr(obj, "__len__") and hasattr(obj, "__getitem__")


def check_dataset(field: str, value: Any, dataset: Any) -> None:
    missing = [m for m in ("__len__", "__getitem__") if not hasattr(dataset, m)]
    if missing:
        raise UserCodeError(
            f"{field}: {value!r} gave {_describe(dataset)}, which has no {' and no '.join(missing)}; "
            "expected a map-style dataset (len(dataset) and dataset[i] for 0 <= i < len): elastic runs "
            "read samples by global position, so an iterable-only dataset cannot be used"
        )
    try:
        n = len(dataset)
    except Exception as e:  # noqa: BLE001 - a __len__ that raises is reported like a missing one
        raise UserCodeError(f"{field}: len() of {_describe(dataset)} raised {type(e).__name__}: {e}") from e
    if not isinstance(n, int) or n < 1:
        raise UserCodeError(f"{field}: {value!r} gave a dataset of length {n!r}; expected at least 1 sample")


def user_callable(config: Any, field: str) -> Callable[..., Any] | None:
    fn = resolve(config, field)
    if fn is not None and not callable(fn):
        value = _field_value(config, field)
        raise UserCodeError(f"{field}: {value!r} is {_describe(fn)}; expected a callable")
    return fn


def _user_module_names(config: Any) -> list[str]:
    """The modules the run's user code comes from: of each import path a field names, and of each object
    given to fit() (`__main__` for what the user's script defined)."""
    modules = [v.partition(":")[0] for v in (_field_value(config, f) for f in FIELDS) if v and v[0] != "<"]
    return modules + [getattr(o, "__module__", None) or type(o).__module__ for o in attached(config).values()]


def imports_user_modules(config: Any) -> bool:
    """Whether workers import a module of the user's for this run: a field naming an import path, or an
    object given to fit() from a module (pickled by reference). Only objects of `__main__` travel whole."""
    return any(name != "__main__" for name in _user_module_names(config))


def share_module_roots(config: Any) -> list[str]:
    """Put the folders holding the user modules on PYTHONPATH, for workers started from this process.

    A worker on this machine then imports `mypkg.models` (or the module of a function given to fit,
    which Ray pickles by reference) as the driver did. Workers on other machines need the package
    installed there (or Ray's runtime_env working_dir).
    """
    roots: list[str] = []
    for name in _user_module_names(config):
        module = sys.modules.get(name)
        file = getattr(module, "__file__", None)
        if not file or name == "__main__":
            continue
        root = Path(file).resolve().parent
        for _ in range(name.count(".") + (1 if Path(file).name == "__init__.py" else 0)):
            root = root.parent
        if str(root) not in roots:
            roots.append(str(root))
    return add_to_pythonpath(roots)


def add_to_pythonpath(folders: list[str]) -> list[str]:
    """Append to this process's PYTHONPATH the `folders` it lacks (what processes started from here
    inherit); returns those added."""
    current = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    added = [f for f in folders if f not in current]
    if added:
        os.environ["PYTHONPATH"] = os.pathsep.join([*current, *added])
    return added
