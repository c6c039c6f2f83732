"""Building a model's structure without its weights, safely beside threads that build real models.

accelerate's `init_empty_weights` replaces `torch.nn.Module.register_parameter` for every thread while
it is entered, and puts back what it found on exit. The driver builds empty structures (preflight's
memory estimate and LoRA target check, an adapter's export) while other threads of the same process
may build real models (a `--local` run's worker, a test's): those got parameters on the meta device
("Cannot copy out of meta tensor"), and two overlapping entries from two threads left the replacement
in place for good. Here the replacement is installed once and asks a thread-local depth, so only the
thread inside `empty_weights()` gets meta parameters.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

_local = threading.local()
_install_lock = threading.Lock()
_installed = False


def _depth() -> int:
    return int(getattr(_local, "depth", 0))


def _install() -> None:
    global _installed
    with _install_lock:
        if _installed:
            return
        original = torch.nn.Module.register_parameter

        def register_parameter(module: torch.nn.Module, name: str, param: Any) -> None:
            if param is not None and _depth() > 0 and param.device.type != "meta":
                param = _on_meta(param)
            original(module, name, param)

        torch.nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
        _installed = True


def _on_meta(param: torch.nn.Parameter) -> torch.nn.Parameter:
    """The same parameter (its class and attributes) with its data on the meta device."""
    meta = param.detach().to("meta")
    if type(param) is torch.nn.Parameter:
        return torch.nn.Parameter(meta, requires_grad=param.requires_grad)
    return type(param)(meta, **{**param.__dict__, "requires_grad": param.requires_grad})


@contextlib.contextmanager
def empty_weights() -> Iterator[None]:
    """In this thread only: parameters go to the meta device as modules register them (no memory for
    weights), buffers stay real (some models' inits compute with them)."""
    _install()
    _local.depth = _depth() + 1
    try:
        yield
    finally:
        _local.depth -= 1
