"""Rich progress rendering for library progress callbacks ``(description, completed, total)``."""

from __future__ import annotations

from contextlib import contextmanager

from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.text import Text

from .console import err_console


class RateColumn(ProgressColumn):
    """Units per second (tokens/s during capture)."""

    def __init__(self, unit: str = "tok/s"):
        super().__init__()
        self.unit = unit

    def render(self, task) -> Text:
        speed = task.finished_speed or task.speed
        return Text("" if speed is None else f"{speed:,.0f} {self.unit}", style="progress.data.speed")


class CountColumn(ProgressColumn):
    """completed/total (total may be unknown)."""

    def render(self, task) -> Text:
        total = "?" if task.total is None else f"{int(task.total):,}"
        return Text(f"{int(task.completed):,}/{total}")


@contextmanager
def progress_callback(unit: str = "tok/s"):
    """Yield a ``callback(description, completed, total)`` that drives one rich bar per description prefix."""
    columns = (TextColumn("{task.description}"), BarColumn(), CountColumn(),
               RateColumn(unit), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())
    with Progress(*columns, console=err_console, transient=False) as bar:
        tasks: dict[str, int] = {}

        def callback(description: str, completed: int, total: int | None) -> None:
            key = description.split(":")[0]
            if key not in tasks:
                tasks[key] = bar.add_task(description, total=total, completed=completed)
            bar.update(tasks[key], description=description, completed=completed, total=total)

        yield callback
