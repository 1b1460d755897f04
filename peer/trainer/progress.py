"""A trainer's progress for a person watching: a live rich bar on a terminal, plain lines in a log.

On a terminal the bar shows the run's step out of its total, samples/s, the training and
validation loss and how many calls were rerouted, redrawn in place. Written to a file or pipe,
there is no bar: with `trainer.progress` set, one plain line every `period` seconds instead.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from peer.process.status_lines import say


def _loss(value: float | None) -> str:
    return f"{value:.3f}" if value is not None else "-"


class TrainerProgress:
    def __init__(self, total_steps: int, lines: bool, period: float = 2.0, console: Console | None = None):
        self.console = console or Console()
        self.total, self.period, self._last = total_steps, period, 0.0
        self.bar: Progress | None = None
        self.lines = lines and not self.console.is_terminal
        if self.console.is_terminal:
            self.bar = Progress(
                TextColumn("[bold]step"),
                BarColumn(bar_width=30),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                console=self.console,
                refresh_per_second=2,
            )
            self.task = self.bar.add_task("train", total=total_steps, info="joining...")
            self.bar.start()

    def update(self, step: int, samples_per_second: float, train_loss: float | None, val_loss, rerouted: int) -> None:
        info = f"{samples_per_second:6.1f} samples/s | train loss {_loss(train_loss)} | val loss {_loss(val_loss)}"
        if rerouted:
            info += f" | {rerouted} calls rerouted"
        if self.bar is not None:
            self.bar.update(self.task, completed=min(step, self.total), info=info)
        elif self.lines and time.monotonic() - self._last >= self.period:
            self._last = time.monotonic()
            say(f"step {step}/{self.total} | {info}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
