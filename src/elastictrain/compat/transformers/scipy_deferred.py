"""transformers' loss modules imported without SciPy's optimizer, which only object-detection losses call."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any

from elastictrain.compat.registry import patch

_STUB = "scipy.optimize"


def _check() -> str | None:
    if importlib.util.find_spec("transformers.loss.loss_utils") is None:
        return "transformers has no transformers.loss.loss_utils"
    return None


def _import_plainly() -> None:
    import transformers.loss.loss_utils  # noqa: F401


def _real_optimize() -> Any:
    """SciPy's own `scipy.optimize`, imported at the first use (the stand-in leaves sys.modules first)."""
    if isinstance(sys.modules.get(_STUB), _StandIn):
        del sys.modules[_STUB]
    return importlib.import_module(_STUB)


class _StandIn(types.ModuleType):
    """Stands for `scipy.optimize` while transformers' loss modules import: any name taken from it
    forwards to SciPy's, which is imported at the first call (or at once, for a name it does not know)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(_real_optimize(), name)


def linear_sum_assignment(*args: Any, **kwargs: Any) -> Any:
    """SciPy's `linear_sum_assignment`, imported when called (DETR-family losses' Hungarian matcher)."""
    return _real_optimize().linear_sum_assignment(*args, **kwargs)


@patch(
    "transformers_losses_without_scipy",
    package="transformers",
    tested=">=5.24,<5.25",
    kind="performance",
    check=_check,
    otherwise=_import_plainly,
)
def import_losses_without_scipy() -> None:
    """Import transformers' loss modules with `scipy.optimize` deferred to its first call.

    What: while `transformers.loss.loss_utils` is first imported, `sys.modules["scipy.optimize"]` is a
    stand-in whose `linear_sum_assignment` (the one name those modules take from it) imports SciPy's at
    the first call; any other name imports SciPy's at once. The stand-in leaves `sys.modules` as soon as
    the import is done, so everything else imports SciPy as usual.
    Why: `transformers.modeling_utils` imports every loss, and the object-detection ones import
    `scipy.optimize` (321 SciPy modules) for a matcher no causal LM calls: 0.3-0.4 CPU s of every
    worker, replacement and model-building command on 2 cores.
    Retired by: transformers importing SciPy inside its Hungarian matchers; no upstream issue found.
    """
    if "transformers.loss.loss_utils" in sys.modules or _STUB in sys.modules:
        return
    if importlib.util.find_spec("scipy") is None:
        _import_plainly()  # transformers does not import it then
        return
    stand_in = _StandIn(_STUB)
    stand_in.linear_sum_assignment = linear_sum_assignment  # type: ignore[attr-defined]
    sys.modules[_STUB] = stand_in
    try:
        _import_plainly()
    finally:
        if sys.modules.get(_STUB) is stand_in:
            del sys.modules[_STUB]
