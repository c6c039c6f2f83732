"""transformers' loss modules imported without the modules only unused code of theirs calls: SciPy's
optimizer (object-detection matchers) and boto3 (accelerate's SageMaker config command)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any

from elastictrain.compat.registry import patch

_SCIPY_OPTIMIZE = "scipy.optimize"
_BOTO3 = "boto3"
DEFERRED = (_SCIPY_OPTIMIZE, _BOTO3)


def _check() -> str | None:
    if importlib.util.find_spec("transformers.loss.loss_utils") is None:
        return "transformers has no transformers.loss.loss_utils"
    return None


def _import_plainly() -> None:
    import transformers.loss.loss_utils  # noqa: F401


def _real(name: str) -> Any:
    """The real module `name`, imported at the first use (its stand-in leaves sys.modules first)."""
    if isinstance(sys.modules.get(name), _StandIn):
        del sys.modules[name]
    return importlib.import_module(name)


class _StandIn(types.ModuleType):
    """Stands for a module while transformers' loss modules import: any name taken from it forwards to
    the real module, which is imported at that moment."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(_real(self.__name__), name)


def linear_sum_assignment(*args: Any, **kwargs: Any) -> Any:
    """SciPy's `linear_sum_assignment`, imported when called (DETR-family losses' Hungarian matcher)."""
    return _real(_SCIPY_OPTIMIZE).linear_sum_assignment(*args, **kwargs)


def _stand_in(name: str) -> _StandIn | None:
    """A stand-in for `name`, or None when it is imported already or not installed (then transformers
    and accelerate import nothing of it, or its cost is paid)."""
    if name in sys.modules:
        return None
    top = name.partition(".")[0]
    try:
        spec = importlib.util.find_spec(top)  # of the top package only: a submodule's would import it
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    stand_in = _StandIn(name)
    if top == name:
        stand_in.__spec__ = spec  # accelerate asks find_spec whether boto3 is there: the real answer
    if name == _SCIPY_OPTIMIZE:
        stand_in.linear_sum_assignment = linear_sum_assignment  # type: ignore[attr-defined]
    return stand_in


@patch(
    "transformers_losses_without_unused_imports",
    package="transformers",
    tested=">=5.24,<5.25",
    kind="performance",
    check=_check,
    otherwise=_import_plainly,
)
def import_losses_deferring_unused() -> None:
    """Import transformers' loss modules with `scipy.optimize` and `boto3` deferred to their first use.

    What: while `transformers.loss.loss_utils` is first imported, `sys.modules["scipy.optimize"]` and
    `sys.modules["boto3"]` are stand-ins. The loss modules take `linear_sum_assignment` from the first,
    which imports SciPy's at the first call; accelerate (which the object-detection losses import)
    binds the second in its SageMaker config module, and any name taken from it imports boto3 then. The
    stand-ins leave `sys.modules` as soon as the import is done, so everything else (elastictrain's own
    S3 storage, MLflow) imports the real modules as usual.
    Why: `transformers.modeling_utils` imports every loss; the object-detection ones import
    `scipy.optimize` (321 SciPy modules) for a matcher no causal LM calls, and accelerate, whose
    SageMaker config command imports boto3 (about 100 boto3 and botocore modules) when it is installed.
    On 2 cores that is 0.3-0.4 CPU s (SciPy) and 0.2-0.5 CPU s (boto3) of every worker, replacement
    and model-building command: importing transformers' modeling code in a fresh process took 2.61
    CPU s with boto3 and 2.11 without it (median of 10 each).
    Retired by: transformers importing SciPy inside its Hungarian matchers, and accelerate importing
    boto3 inside its SageMaker functions; no upstream issue found for either.
    """
    if "transformers.loss.loss_utils" in sys.modules:
        return
    stand_ins = {name: s for name in DEFERRED if (s := _stand_in(name)) is not None}
    sys.modules.update(stand_ins)
    try:
        _import_plainly()
    finally:
        for name, stand_in in stand_ins.items():
            if sys.modules.get(name) is stand_in:
                del sys.modules[name]
