"""The CLI's one progress system: it draws the library's :data:`kvhub.progress.Progress` callbacks
``(label, done, total)``.

On a terminal: one Rich bar per step (the description up to its first ``:``).  Anywhere else (a CI
log, a file, ``2>&1 | tee``), or with ``HF_HUB_DISABLE_PROGRESS_BARS`` set: plain lines on stderr,
one per step every ``KVHUB_PROGRESS_INTERVAL`` seconds (default 30) and when a step completes, so a
10-minute fit in a CI log says how far it is without carriage-return bars.  Rates are ``<unit>/s``
(:func:`kvhub.progress.unit_of`; below one a second, seconds per unit: ``2.9 s/item``) and count only this
run's work: a fit resumed from a checkpoint starts its step at the checkpointed count, which neither the
rate nor the eta takes as done now.  Bars and lines compute both alike, from the step's elapsed time, so
they show from the first update on however long a step takes (Rich's own speed looks back only 30 s,
which left a capture of 3-minute batches with no rate and no eta for its whole run).

Other libraries' bars: transformers' (weight loading, GGUF conversion and writing) are switched off while kvhub
loads or converts a model (kvhub.models.loading.quiet_loading); huggingface_hub's are switched off off a terminal,
or wherever ``HF_HUB_DISABLE_PROGRESS_BARS`` asks (huggingface_hub's own setting, honoured by kvhub's
bars too), and during kvhub push and pull (:func:`hub_transfer`), which show kvhub's own instead of
huggingface_hub's per-file and per-stage bars: a spinner for a push, a byte bar for a pull (bytes, rate, eta).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.progress import BarColumn, ProgressColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress
from rich.text import Text

from kvhub.cli.console import err_console, say
from kvhub.env import env_flag
from kvhub.progress import Progress, unit_of

INTERVAL_ENV = "KVHUB_PROGRESS_INTERVAL"
_DEFAULT_INTERVAL_S = 30.0


def rate_text(rate: float, unit: str) -> str:
    """``3,100 tok/s``; below one unit a second the seconds one takes: ``2.9 s/item`` (not ``0 items/s``)."""
    base = unit.removesuffix("/s")
    if rate >= 1:
        return f"{rate:,.0f} {base}/s"
    return f"{1 / rate:,.1f} s/{base[:-1] if base.endswith('s') else base}"


def rate_and_eta(done_now: int, remaining: int | None, elapsed: float) -> tuple[float | None, float | None]:
    """(units per second, seconds left) from what this run did in ``elapsed`` seconds; None before any."""
    if elapsed <= 0 or done_now <= 0:
        return None, None
    rate = done_now / elapsed
    return rate, (remaining / rate if remaining else None)


def _task_progress(task) -> tuple[float | None, float | None]:
    """A Rich task's (rate, eta) over its whole elapsed time, counted from its first value (field ``base``)."""
    elapsed = task.finished_time if task.finished else task.elapsed
    remaining = None if task.total is None else max(0, task.total - task.completed)
    return rate_and_eta(task.completed - task.fields.get("base", 0), remaining, elapsed or 0.0)


class RateColumn(ProgressColumn):
    """Units per second of this run, from the step's first update on (:func:`rate_and_eta`)."""

    def __init__(self, unit: str = "tok/s"):
        super().__init__()
        self.unit = unit

    def render(self, task) -> Text:
        rate, _ = _task_progress(task)
        unit = task.fields.get("unit", self.unit)
        return Text("" if rate is None else rate_text(rate, unit), style="progress.data.speed")


class EtaColumn(ProgressColumn):
    """Time left at this run's rate so far (``-:--:--`` before the first unit is done)."""

    def render(self, task) -> Text:
        _, eta = _task_progress(task)
        if task.finished:
            return Text("0:00", style="progress.remaining")
        return Text("-:--:--" if eta is None else _clock(eta), style="progress.remaining")


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
def hub_transfer(description: str, *, sized: bool = False) -> Iterator[Progress | None]:
    """huggingface_hub's bars off for one push or pull (restored after), and kvhub's own instead.  Yields
    None and shows a spinner saying ``description`` on a terminal; ``sized`` (a pull, whose library call
    reports its bytes): yields a :data:`kvhub.progress.Progress` callback drawn as one byte bar (size, rate,
    eta) on a terminal, plain lines in bytes elsewhere."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        if sized and bars_wanted():
            with RichProgress(*_byte_columns(), console=err_console, transient=True) as bar:
                task = bar.add_task(description, total=None)
                yield lambda label, done, total: bar.update(task, completed=done, total=total)
        elif sized:
            yield LineProgress("B", interval=_interval())
        elif bars_wanted():
            with err_console.status(description):
                yield None
        else:
            yield None
    finally:
        if not was_disabled:
            enable_progress_bars()


def _byte_columns() -> tuple[ProgressColumn, ...]:
    """``⠏ pulling acme/x@v1 ━━━━╺━━━ 58.6/117.2 MB 12.1 MB/s 0:00:05``."""
    from rich.progress import DownloadColumn, SpinnerColumn, TimeRemainingColumn, TransferSpeedColumn

    return (
        SpinnerColumn(),
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )


def _interval() -> float:
    try:
        return max(0.0, float(os.environ.get(INTERVAL_ENV, _DEFAULT_INTERVAL_S)))
    except ValueError:
        return _DEFAULT_INTERVAL_S


def _size(num_bytes: float) -> str:
    from kvhub.cli.output import format_size

    return format_size(num_bytes)


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
        unit = unit_of(description, self.unit)
        count = _size if unit == "B" else "{:,}".format
        parts = [f"{description}: {count(completed)}/{'?' if total is None else count(total)}"]
        if total:
            parts[0] += f" ({100 * completed / total:.0f}%)"
        remaining = None if not total else max(0, total - completed)
        rate, eta = rate_and_eta(completed - base, remaining, elapsed)
        if rate is not None:
            parts.append(f"{_size(rate)}/s" if unit == "B" else rate_text(rate, unit))
        parts.append(f"{_clock(elapsed)} elapsed")
        if eta is not None:
            parts.append(f"eta {_clock(eta)}")
        return ", ".join(parts)


@contextmanager
def progress_callback(unit: str = "tok/s") -> Iterator[Progress]:
    """Yield a :data:`kvhub.progress.Progress` callback: Rich bars on a terminal, plain periodic lines
    elsewhere (module docstring)."""
    quiet_other_bars()
    if not bars_wanted():
        yield LineProgress(unit, interval=_interval())
        return
    with RichProgress(*bar_columns(unit), console=err_console, transient=False) as bar:
        yield bar_callback(bar, unit)


def bar_columns(unit: str) -> tuple[ProgressColumn, ...]:
    """A bar's columns: ``capture: train batch 3/20 ━━╺━━ 6,144/40,960 11 tok/s 0:09:18 eta 0:52:39``."""
    return (
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        CountColumn(),
        RateColumn(unit),
        TimeElapsedColumn(),
        TextColumn("eta"),
        EtaColumn(),
    )


def bar_callback(bar: RichProgress, unit: str) -> Progress:
    """The :data:`kvhub.progress.Progress` callback drawing one task of ``bar`` per step; a step's first count
    is its ``base`` (a resumed fit's checkpointed tokens), which the rate and the eta do not count."""
    tasks: dict[str, int] = {}

    def callback(description: str, completed: int, total: int | None) -> None:
        key = description.split(":")[0]
        if key not in tasks:
            tasks[key] = bar.add_task(
                description, total=total, completed=completed, unit=unit_of(description, unit), base=completed
            )
        bar.update(tasks[key], description=description, completed=completed, total=total)

    return callback
