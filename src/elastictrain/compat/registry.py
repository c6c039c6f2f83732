"""The registry of every change elastictrain makes to DeepSpeed, torch.distributed (gloo), transformers,
MLflow and py-cpuinfo internals, and the rule that decides, once per process, whether each applies.

A patch is a named function (its docstring: what it changes, why, and what upstream change retires it)
declared with `@patch(...)`: the package it reaches into, the releases it was checked on (`tested`), its
kind, what it gains a user (`gains`: a figure measured at 125M parameters or more, or the correctness or
design reason; a patch whose only gain is seconds of a process's imports or start-up has no place here),
and a `check` that verifies its target exists with the shape it expects. Before the first use:

- inside the tested range and the check passes: the patch applies;
- otherwise a "performance" or "memory" patch is skipped (DeepSpeed's own code runs), with one warning
  per process naming the patch, the installed version and what differed;
- a "correctness" patch refuses: `CompatError` names the patch, the installed version and the tested
  range, before training starts (`check_all` in the worker's warm-up and set-up,
  `refuse_unsupported_versions` on the driver).

Without this a guard that found no target (an isinstance check that no longer matched, a getattr with a
default) skipped silently, and a new DeepSpeed would have leaked memory or slowed down unseen.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from packaging.specifiers import SpecifierSet
from packaging.version import Version

Kind = Literal["performance", "memory", "correctness"]
SKIPPABLE: tuple[Kind, ...] = ("performance", "memory")

# The DeepSpeed releases the patches were checked on (`make test-compat DEEPSPEED=X`, docs/reference/
# deepspeed-compatibility.md). A release outside it skips the time and memory patches and refuses to
# start where correctness depends on one.
DEEPSPEED_TESTED = ">=0.19.7,<=0.19.8"

# The modules that declare patches: `all_patches()` imports them (each imports its package lazily).
PATCH_MODULES = (
    "elastictrain.compat.deepspeed.process_state",
    "elastictrain.compat.deepspeed.cpu_info",
    "elastictrain.compat.deepspeed.zero3_build",
    "elastictrain.compat.deepspeed.zero3_memory",
    "elastictrain.compat.deepspeed.swap_buffers",
    "elastictrain.compat.deepspeed.optimizer_state",
    "elastictrain.compat.deepspeed.skip_update",
    "elastictrain.compat.torch_dist.gloo_gather",
    "elastictrain.compat.torch_dist.process_group",
    "elastictrain.compat.transformers.hf_init",
    "elastictrain.compat.transformers.preload",
    "elastictrain.compat.mlflow.artifact_cache",
    "elastictrain.compat.peft.zero3",
)

Check = Callable[[], "str | None"]  # None: the target has the expected shape; else what differs


class CompatError(RuntimeError):
    """A patch that correctness depends on cannot apply to the installed release."""


class CompatWarning(UserWarning):
    """A time or memory patch was skipped: DeepSpeed's (or the package's) own code runs instead."""


@dataclass(frozen=True)
class Patch:
    name: str
    package: str  # the distribution it reaches into, as pip names it
    tested: str  # a PEP 440 specifier: the releases it was checked on
    kind: Kind
    check: Check
    function: str  # module:qualname of the patch function
    doc: str  # its docstring: what it changes, why, and what retires it
    gains: str  # what a user gains: measured at 125M or more (or on the GPU check), or the reason

    def problem(self) -> str | None:
        """Why this patch cannot apply here (a version outside `tested`, a target of another shape)."""
        version = installed_version(self.package)
        if version is None:
            return f"{self.package} is not installed"
        if Version(version) not in SpecifierSet(self.tested):
            return f"{self.package} {version} is outside the tested range {self.tested}"
        try:
            found = self.check()
        except Exception as e:  # noqa: BLE001 - a missing module or attribute is a shape mismatch
            found = f"{type(e).__name__}: {e}"
        return None if found is None else f"{self.package} {version}: {found}"


PATCHES: dict[str, Patch] = {}
_decided: dict[str, bool] = {}

F = TypeVar("F", bound=Callable[..., Any])


def installed_version(package: str) -> str | None:
    """The release of `package` this process imports: the module's own `__version__` once imported (a
    `make test-compat` copy first on PYTHONPATH), its distribution's metadata otherwise."""
    module = sys.modules.get(package.replace("-", "_"))
    version = getattr(module, "__version__", None) if module is not None else None
    if isinstance(version, str):
        return version.split("+")[0]
    try:
        return importlib.metadata.version(package).split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        return None


def patch(
    name: str,
    *,
    package: str,
    kind: Kind,
    check: Check,
    gains: str,
    tested: str = DEEPSPEED_TESTED,
    otherwise: Callable[..., Any] | None = None,
) -> Callable[[F], F]:
    """Declare the function below as patch `name`, and run it only where the patch applies: where it
    does not, a skippable patch calls `otherwise` (same arguments) instead; a correctness one raises.

    `gains`: what a user gains from it, one line for the compatibility table."""
    if not gains.strip():
        raise ValueError(f"patch {name}: say what it gains a user (gains=...)")

    def declare(function: F) -> F:
        if name in PATCHES:
            raise ValueError(f"patch {name} declared twice")
        PATCHES[name] = Patch(
            name,
            package,
            tested,
            kind,
            check,
            f"{function.__module__}:{function.__qualname__}",
            inspect.getdoc(function) or "",
            gains.strip(),
        )
        if kind == "correctness" and otherwise is not None:
            raise ValueError(f"patch {name}: a correctness patch has no fallback")

        @functools.wraps(function)
        def gated(*args: Any, **kwargs: Any) -> Any:
            if active(name):
                return function(*args, **kwargs)
            assert otherwise is not None
            return otherwise(*args, **kwargs)

        return gated  # type: ignore[return-value]

    return declare


def part_of(name: str) -> Callable[[F], F]:
    """A further function of patch `name` (declared elsewhere with `@patch`): run only where it applies."""

    def gate(function: F) -> F:
        @functools.wraps(function)
        def gated(*args: Any, **kwargs: Any) -> Any:
            if not active(name):
                raise CompatError(f"{function.__qualname__} is part of patch {name}, which does not apply")
            return function(*args, **kwargs)

        return gated  # type: ignore[return-value]

    return gate


def active(name: str) -> bool:
    """Whether patch `name` applies in this process (decided at its first use, then remembered).

    A skippable patch that cannot apply warns once and is off; a correctness one raises `CompatError`."""
    decided = _decided.get(name)
    if decided is not None:
        return decided
    found = PATCHES[name]
    problem = found.problem()
    if problem is not None and found.kind == "correctness":
        raise CompatError(
            f"elastictrain cannot run with this release: patch {name} ({found.function}), which "
            f"correctness depends on, does not apply: {problem}; tested: {found.package}{found.tested}. "
            f"Install a tested release (pip install -c constraints.txt) or see "
            f"docs/reference/deepspeed-compatibility.md"
        )
    if problem is not None:
        warnings.warn(
            f"elastictrain: patch {name} ({found.kind}) skipped, {found.package}'s own code runs: {problem}",
            CompatWarning,
            stacklevel=3,
        )
    _decided[name] = problem is None
    return problem is None


def all_patches() -> dict[str, Patch]:
    """Every declared patch, by name (importing the modules that declare them)."""
    for module in PATCH_MODULES:
        importlib.import_module(module)
    return dict(PATCHES)


def check_all(packages: tuple[str, ...] | None = None) -> dict[str, bool]:
    """Decide every patch (of `packages`, or all) now: warnings for skipped ones, and one `CompatError`
    naming every correctness patch that cannot apply. Returns name -> applies."""
    out: dict[str, bool] = {}
    refused: list[str] = []
    for name, found in all_patches().items():
        if packages is not None and found.package not in packages:
            continue
        try:
            out[name] = active(name)
        except CompatError as e:
            refused.append(str(e))
    if refused:
        raise CompatError("\n".join(refused))
    return out


def refuse_unsupported_versions() -> None:
    """On the driver, before any worker starts: refuse a release outside the range of a patch that
    correctness depends on (versions only: the shapes are checked where the packages are imported)."""
    problems = []
    for name, found in all_patches().items():
        version = installed_version(found.package)
        if (
            found.kind == "correctness"
            and version is not None
            and Version(version) not in SpecifierSet(found.tested)
        ):
            problems.append(f"patch {name}: {found.package} {version} is outside {found.tested}")
    if problems:
        raise CompatError(
            "elastictrain refuses to start: patches that correctness depends on were not tested with the "
            "installed releases: " + "; ".join(problems) + " (pip install -c constraints.txt; see "
            "docs/reference/deepspeed-compatibility.md)"
        )


def forget_decisions() -> None:
    """Decide again at the next use (tests that simulate another release)."""
    _decided.clear()


# Shape checks shared by the patch modules.


def has_attributes(target: Any, *names: str) -> str | None:
    """None when `target` has every attribute in `names`; else which it lacks."""
    missing = [n for n in names if not hasattr(target, n)]
    return f"{getattr(target, '__name__', target)} has no {', '.join(missing)}" if missing else None


def has_fields(cls: Any, *names: str) -> str | None:
    """None when class `cls` declares every field in `names` (a dataclass's annotations); else which not."""
    declared = {n for klass in getattr(cls, "__mro__", (cls,)) for n in getattr(klass, "__annotations__", {})}
    missing = [n for n in names if n not in declared]
    return f"{getattr(cls, '__name__', cls)} has no field {', '.join(missing)}" if missing else None


def has_parameters(function: Any, *names: str, where: str = "") -> str | None:
    """None when callable `function` takes parameters named `names` (in that order, first ones); else
    what it takes instead."""
    label = where or getattr(function, "__qualname__", repr(function))
    if not callable(function):
        return f"{label} is not callable"
    try:
        params = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return f"{label}: no signature to check"
    for i, expected in enumerate(names):
        if i < len(params) and params[i].kind is inspect.Parameter.VAR_POSITIONAL:
            return None  # `*args` (a wrapper, a test's counting stand-in) takes the rest
        if i >= len(params) or params[i].name != expected:
            taken = ", ".join(p.name for p in params)
            return f"{label} takes ({taken}), expected ({', '.join(names)}, ...)"
    return None


def first_problem(*found: str | None) -> str | None:
    return next((f for f in found if f is not None), None)


def shape_mismatch(name: str, found: str) -> None:
    """A skippable patch found, at run time, a target of another shape than its check could see (an
    instance attribute): off for the rest of the process, said once."""
    if _decided.get(name) is False:
        return
    _decided[name] = False
    found_patch = PATCHES[name]
    version = installed_version(found_patch.package)
    warnings.warn(
        f"elastictrain: patch {name} ({found_patch.kind}) skipped, {found_patch.package}'s own code runs: "
        f"{found_patch.package} {version}: {found}",
        CompatWarning,
        stacklevel=3,
    )
