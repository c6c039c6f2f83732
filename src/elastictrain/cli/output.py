"""What every CLI command prints with: the consoles, the error exit, and the checkpoint a command uses."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.text import Text

from elastictrain.redact import redact_text

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def fail(message: str, code: int = 2) -> NoReturn:
    # The message is plain text: config paths like [a, b] must not be read as rich markup.
    err.print(Text.assemble(("error: ", "bold red"), redact_text(message)))
    raise typer.Exit(code)


def choose(checkpoint: str | Path) -> Any:
    """The checkpoint a command uses; says which and why, when a newer folder is not one."""
    from elastictrain.checkpoint.choice import choose_checkpoint
    from elastictrain.checkpoint.store import CheckpointError

    try:
        choice = choose_checkpoint(checkpoint)
    except CheckpointError as e:
        fail(str(e))
    if choice.passed_over:
        err.print(Text.assemble(("note: ", "bold yellow"), choice.describe()))
    return choice.path
