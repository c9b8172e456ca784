"""What the user sees while training: a rich progress bar on the main process, with the log lines
(accelerate's per-rank logger) printed above it through the same console."""

from __future__ import annotations

import logging
import sys
from typing import Any

from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

_console: Console | None = None


def console() -> Console:
    global _console
    if _console is None:
        _console = Console(stderr=True)
    return _console


def interactive() -> bool:
    """A terminal is watching (rich draws the bar); otherwise plain log lines, no bar."""
    return console().is_terminal


def configure_logging(is_main: bool) -> None:
    """INFO on the main process (through rich, above the bar, in a terminal), WARNING elsewhere."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    if is_main and interactive():
        handler: logging.Handler = RichHandler(console=console(), show_path=False, markup=False,
                                               log_time_format="[%X]")
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(logging.INFO if is_main else logging.WARNING)


def show_block(logger: Any, title: str, lines: list[str]) -> None:
    """A block of lines the user copies from (paths, commands): in a terminal, printed whole through rich's console
    (soft wrap: a long command stays one line to copy, where the log handler would wrap it); else one log record."""
    if interactive():
        console().print(title + "".join(f"\n  {line}" for line in lines), soft_wrap=True, markup=False,
                        highlight=False)
    else:
        logger.info(title + "".join(f"\n  {line}" for line in lines))


class ProgressDisplay:
    """Steps done of the total, speed, ETA and the last logged loss; a no-op when disabled."""

    def __init__(self, enabled: bool, total: int, completed: int) -> None:
        self.enabled = enabled and interactive()
        self._progress: Progress | None = None
        self._task: Any = None
        if self.enabled:
            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TimeRemainingColumn(), TextColumn("{task.fields[info]}"), console=console(), transient=False,
            )
            self._task = self._progress.add_task("train", total=total, completed=completed, info="")

    def __enter__(self) -> ProgressDisplay:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.stop()

    def update(self, step: int, info: str | None = None) -> None:
        if self._progress is None:
            return
        fields = {"info": info} if info is not None else {}
        self._progress.update(self._task, completed=step, **fields)


__all__ = ["ProgressDisplay", "configure_logging", "console", "interactive", "show_block"]
