"""Replacing a package's function for the threads inside a block only.

A patch that sets a module attribute on entry and puts back "what it found" on exit is wrong as soon as
two threads of one process use it: a thread that enters while another is inside saves the other's
replacement as the original and puts it back last, so the replacement stays for good; and meanwhile a
thread that never entered runs the replacement too. One process does build models on several threads:
a `--local` run's worker beside the driver, tests beside a run's leftover warm-up, and so on; a model
built by the wrong thread under "skip the parameter init" silently keeps uninitialised weights.

Here the first entrant (of any thread) installs a dispatcher that calls, for each thread, the
replacement it entered last, or the original where it entered none; the last one out puts the original
back. Nested blocks in one thread compose: each replacement is made from what the thread would have
called before it.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

_lock = threading.Lock()
_local = threading.local()


@dataclass
class _Installed:
    original: Any
    dispatcher: Any
    users: int = 0


_installed: dict[tuple[int, str], _Installed] = {}


def _stack(key: tuple[int, str]) -> list[Any]:
    stacks: dict[tuple[int, str], list[Any]] = _local.__dict__.setdefault("stacks", {})
    return stacks.setdefault(key, [])


@contextmanager
def replaced_in_this_thread(owner: Any, name: str, make: Callable[[Any], Any]) -> Iterator[None]:
    """`owner.name` is `make(what this thread called until now)` for this thread while the block runs;
    other threads keep calling what they called (the original, or their own replacement).

    `owner` is a module or a class (for a method, `make`'s function takes `self` first, as the
    original does)."""
    key = (id(owner), name)
    with _lock:
        entry = _installed.get(key)
        if entry is None:
            original = getattr(owner, name)

            @functools.wraps(original)
            def dispatch(*args: Any, **kwargs: Any) -> Any:
                stack = _stack(key)
                return (stack[-1] if stack else original)(*args, **kwargs)

            entry = _installed[key] = _Installed(original, dispatch)
            setattr(owner, name, dispatch)
        entry.users += 1
    stack = _stack(key)
    stack.append(make(stack[-1] if stack else entry.original))
    try:
        yield
    finally:
        stack.pop()
        with _lock:
            entry.users -= 1
            if entry.users == 0:
                del _installed[key]
                if getattr(owner, name) is entry.dispatcher:  # else someone replaced it since: theirs stays
                    setattr(owner, name, entry.original)
