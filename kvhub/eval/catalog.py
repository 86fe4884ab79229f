"""The task names ``kvhub eval`` takes, without importing torch (the CLI reads them to build its options).

Multiple choice: :data:`kvhub.eval.tasks.MC_TASKS`; ``ppl``: perplexity on a fixed text set
(:mod:`kvhub.eval.perplexity`); long context, scored exactly: :mod:`kvhub.eval.longctx` (the follow-up turn: :mod:`kvhub.eval.followup`;
RULER-style tasks: :mod:`kvhub.eval.ruler`); the gist of a
long context: :mod:`kvhub.eval.gist`; the turns after an escalation, served only: :mod:`kvhub.eval.served_turns`.  Those modules take their lists from here.
"""

from __future__ import annotations

from kvhub.eval.tasks import MC_TASKS

RULER_TASKS = ("niah-multikey", "vt", "cwe")  # kvhub.eval.ruler
LONG_TASKS = ("facts", "multiturn", "code", "followup") + RULER_TASKS
GIST_KINDS = ("chat", "document", "code")
GIST_TASKS = tuple(f"gist-{kind}" for kind in GIST_KINDS)
SERVED_LONG_TASKS = tuple(t for t in LONG_TASKS if t != "followup")  # the follow-up's turns are library-only
SERVED_TURN_TASKS = ("turns",)  # kvhub.eval.served_turns: turns after an escalation, through kvhub serve only
TASKS = MC_TASKS + ("ppl",) + LONG_TASKS + GIST_TASKS

__all__ = [
    "GIST_KINDS",
    "GIST_TASKS",
    "LONG_TASKS",
    "MC_TASKS",
    "RULER_TASKS",
    "SERVED_LONG_TASKS",
    "SERVED_TURN_TASKS",
    "TASKS",
]
