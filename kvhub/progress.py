"""The progress protocol: how library code says how far a long step is; only kvhub.cli draws it.

    progress(label, done, total)

``label`` names the step (``"capture"``, ``"fetch spdx==2.5.1"``); the CLI keeps one bar or line per
text before the first ``:``, so ``"capture: layer 3"`` updates the ``capture`` bar.  ``done`` counts the
units finished so far (tokens, bytes, documents) and never decreases within a step; ``total`` is the
number of units in all, or None while unknown; ``done == total`` ends the step.  Library functions take
``progress: Progress | None = None`` and report through :func:`report`; kvhub.cli.progress builds the
callbacks (bars on a terminal, plain periodic lines elsewhere).  What ``done`` counts is named by the
step's first word in :data:`STEP_UNITS` (the CLI shows a rate as ``<unit>/s``); other steps count in
the unit the caller's callback was made for.
"""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[str, int, "int | None"], None]

# The unit of ``done`` for the steps kvhub's library reports, by the first word of their label.
STEP_UNITS = {
    "capture": "tok",
    "tokenize": "tok",
    "read": "files",
    "fetch": "wheels",
    "download": "wheels",
    "convert": "steps",
    "solve": "layers",
    "bench": "repeats",
    "pull": "B",
}


def unit_of(label: str, default: str) -> str:
    """The unit ``done`` counts in for a step ``label`` (:data:`STEP_UNITS`), else ``default``."""
    words = label.split(":")[0].split()
    return STEP_UNITS.get(words[0], default) if words else default


def report(progress: Progress | None, label: str, done: int, total: int | None) -> None:
    """Call ``progress(label, done, total)`` when a callback was given."""
    if progress is not None:
        progress(label, done, total)
