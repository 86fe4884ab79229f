"""The CLI's one progress system: it draws the library's :data:`kvhub.progress.Progress` callbacks
``(label, done, total)``.

On a terminal: one Rich bar per step (the description up to its first ``:``).  Anywhere else (a CI
log, a file, ``2>&1 | tee``), or with ``HF_HUB_DISABLE_PROGRESS_BARS`` set: plain lines on stderr,
one per step every ``KVHUB_PROGRESS_INTERVAL`` seconds (default 30) and when a step completes, so a
10-minute fit in a CI log says how far it is without carriage-return bars.  Rates are ``<unit>/s``
(:func:`kvhub.progress.unit_of`) and count only this run's work: a fit resumed from a checkpoint starts
its step at the checkpointed count, which neither the rate nor the eta takes as done now.

Other libraries' bars: transformers' (weight loading, GGUF conversion) are switched off while kvhub
loads a model (kvhub.models.loading.quiet_loading); huggingface_hub's are switched off off a terminal,
or wherever ``HF_HUB_DISABLE_PROGRESS_BARS`` asks (huggingface_hub's own setting, honoured by kvhub's
bars too), and during kvhub push and pull (:func:`hub_transfer`), which show one kvhub line instead of
huggingface_hub's per-file and per-stage bars.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.progress import BarColumn, ProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress
from rich.text import Text

from kvhub.cli.console import err_console, say
from kvhub.env import env_flag
from kvhub.progress import Progress, unit_of

INTERVAL_ENV = "KVHUB_PROGRESS_INTERVAL"
_DEFAULT_INTERVAL_S = 30.0


def per_second(unit: str) -> str:
    """``tok`` -> ``tok/s`` (a unit given as ``tok/s`` stays)."""
    return unit if unit.endswith("/s") else f"{unit}/s"


class RateColumn(ProgressColumn):
    """Units per second of this run (Rich's speed counts the increments after a task's first value)."""

    def __init__(self, unit: str = "tok/s"):
        super().__init__()
        self.unit = unit

    def render(self, task) -> Text:
        speed = task.finished_speed or task.speed
        unit = per_second(task.fields.get("unit", self.unit))
        return Text("" if speed is None else f"{speed:,.0f} {unit}", style="progress.data.speed")


class CountColumn(ProgressColumn):
    """completed/total (total may be unknown)."""

    def render(self, task) -> Text:
        total = "?" if task.total is None else f"{int(task.total):,}"
        return Text(f"{int(task.completed):,}/{total}")


def bars_wanted() -> bool:
    """Rich bars only on a terminal and unless HF_HUB_DISABLE_PROGRESS_BARS is set."""
    return err_console.is_terminal and not env_flag("HF_HUB_DISABLE_PROGRESS_BARS")


def quiet_other_bars(*, load_transformers: bool = False) -> None:
    """Switch off huggingface_hub's bars off a terminal (or when asked), and transformers' always (when
    it is imported, or ``load_transformers`` for commands about to load models)."""
    if not bars_wanted():
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # read by huggingface_hub when it is imported
        if "huggingface_hub" in sys.modules:
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()
    if load_transformers or "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()


@contextmanager
def hub_transfer(description: str) -> Iterator[None]:
    """huggingface_hub's bars off for one push or pull, and on a terminal a kvhub spinner saying
    ``description`` instead; the bars' setting is restored after."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        if bars_wanted():
            with err_console.status(description):
                yield
        else:
            yield
    finally:
        if not was_disabled:
            enable_progress_bars()


def _interval() -> float:
    try:
        return max(0.0, float(os.environ.get(INTERVAL_ENV, _DEFAULT_INTERVAL_S)))
    except ValueError:
        return _DEFAULT_INTERVAL_S


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class LineProgress:
    """``callback(description, completed, total)`` writing a plain status line per step at most every
    ``interval`` seconds, and once when the step completes: ``capture: 120/480 (25%), 3,100 tok/s,
    1:23 elapsed, eta 4:09``.  A step's first count (a resumed fit's checkpointed tokens) is its
    baseline: rate and eta count what this run did since."""

    def __init__(self, unit: str, *, interval: float, clock=time.monotonic, write=say):
        self.unit, self.interval, self.clock, self.write = unit, interval, clock, write
        self.steps: dict[str, dict] = {}

    def __call__(self, description: str, completed: int, total: int | None) -> None:
        now = self.clock()
        step = self.steps.setdefault(
            description.split(":")[0], {"start": now, "shown": None, "finished": False, "base": completed}
        )
        finished = total is not None and completed >= total
        due = step["shown"] is None or now - step["shown"] >= self.interval
        if step["finished"] or not (due or finished):
            return
        step["shown"], step["finished"] = now, finished
        self.write(self.line(description, completed, total, now - step["start"], base=step["base"]))

    def line(self, description: str, completed: int, total: int | None, elapsed: float, *, base: int = 0) -> str:
        """The status line; ``base``: the step's count when this run started it."""
        parts = [f"{description}: {completed:,}/{'?' if total is None else f'{total:,}'}"]
        if total:
            parts[0] += f" ({100 * completed / total:.0f}%)"
        done_now = completed - base
        if elapsed > 0 and done_now > 0:
            parts.append(f"{done_now / elapsed:,.0f} {per_second(unit_of(description, self.unit))}")
        parts.append(f"{_clock(elapsed)} elapsed")
        if total and completed < total and elapsed > 0 and done_now > 0:
            parts.append(f"eta {_clock(elapsed * (total - completed) / done_now)}")
        return ", ".join(parts)


@contextmanager
def progress_callback(unit: str = "tok/s") -> Iterator[Progress]:
    """Yield a :data:`kvhub.progress.Progress` callback: Rich bars on a terminal, plain periodic lines
    elsewhere (module docstring)."""
    quiet_other_bars()
    if not bars_wanted():
        yield LineProgress(unit, interval=_interval())
        return
    columns = (
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        CountColumn(),
        RateColumn(unit),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
    )
    with RichProgress(*columns, console=err_console, transient=False) as bar:
        tasks: dict[str, int] = {}

        def callback(description: str, completed: int, total: int | None) -> None:
            key = description.split(":")[0]
            if key not in tasks:
                tasks[key] = bar.add_task(
                    description, total=total, completed=completed, unit=unit_of(description, unit)
                )
            bar.update(tasks[key], description=description, completed=completed, total=total)

        yield callback
