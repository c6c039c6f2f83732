"""What the user sees in the terminal: a progress bar with step metrics, and one line per event.

On a TTY a rich progress bar (with ETA) is redrawn in place; elsewhere (job logs, CI, pipes) each
logged step is one plain line, so `ray job logs` stays readable.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from elastictrain.redact import redact_text


class Reporter:
    def __init__(self, total_steps: int, *, stream: TextIO | None = None, live: bool | None = None) -> None:
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty() if live is None else live
        self.console = Console(file=self.stream, force_terminal=self.live, highlight=False, soft_wrap=True)
        self.total = total_steps
        self._progress: Progress | None = None
        self._task: Any = None
        self._t0 = time.monotonic()
        self._steps_done_at_start = 0

    def start(self, initial_step: int) -> None:
        self._steps_done_at_start = initial_step
        self._t0 = time.monotonic()
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[metrics]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._progress.start()
            self._task = self._progress.add_task(
                "train", total=self.total, completed=initial_step, metrics=""
            )

    def step(self, step: int, m: dict[str, float], log_line: bool) -> None:
        text = (
            f"loss {m['loss']:.4f} lr {m['lr']:.2e} {m['samples_per_s']:.1f} samples/s "
            f"{m['tokens_per_s']:.0f} tok/s world {int(m['world_size'])}"
        )
        if "rewards/margins" in m:  # a preference objective: what TRL users watch
            text += f" margin {m['rewards/margins']:.3f} acc {m['rewards/accuracies']:.2f}"
        elif "kl" in m:
            text += f" kl {m['kl']:.3f}"
        if self._progress is not None:
            self._progress.update(self._task, completed=step, metrics=text)
        elif log_line:
            done = step - self._steps_done_at_start
            elapsed = time.monotonic() - self._t0
            eta = elapsed / done * (self.total - step) if done > 0 else float("nan")
            self.console.print(f"step {step}/{self.total} {text} eta {eta:.0f}s")

    def event(self, message: str, style: str = "") -> None:
        # Plain text: messages carry config values such as [2, 3] that must not be read as markup.
        self.console.print(Text(redact_text(message), style=style))

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
