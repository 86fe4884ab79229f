"""The task registry ``kvhub eval`` and ``kvhub eval-serve`` both read: name -> ``"module:Class"``, without torch.

Names are cheap to list (the CLI builds its options from them); a class is imported on first use
(:func:`task_class`), as lm-eval's task registry does.  Each entry says where its task runs: ``library``
(``kvhub eval``: the handoff in this process, :class:`kvhub.eval.conditions.LibraryConditions`) and / or
``served`` (``kvhub eval-serve``: a running ``kvhub serve`` pair, :class:`kvhub.eval.served_conditions.ServedConditions`).
A task class has ``tasks(name, conditions, options) -> list`` (one :class:`kvhub.eval.run.Task` per setting);
adding a task is that class and one :func:`register` line.

Multiple choice: :data:`kvhub.eval.tasks.MC_TASKS`; ``ppl``: perplexity on a fixed text set
(:mod:`kvhub.eval.perplexity`); long context, scored exactly: :mod:`kvhub.eval.recall_tasks` (items from
:mod:`kvhub.eval.longctx`, the follow-up turn :mod:`kvhub.eval.followup`, RULER-style :mod:`kvhub.eval.ruler`);
the gist of a long context: :mod:`kvhub.eval.gist`, and its suite of six domains with dev and test splits
(``gist`` / ``gist-dev``): :mod:`kvhub.eval.gist_suite`; the turns after an escalation, served only:
:mod:`kvhub.eval.served_turns`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from kvhub.eval.tasks import MC_TASKS

LIBRARY, SERVED = "library", "served"  # where a task's conditions run (kvhub eval, kvhub eval-serve)


@dataclass(frozen=True)
class Entry:
    """A registered task: ``target`` its class as ``"module:Class"``; ``runs_on`` where it runs."""

    target: str
    runs_on: tuple[str, ...] = (LIBRARY,)


REGISTRY: dict[str, Entry] = {}


def register(name: str, target: str, *, runs_on: tuple[str, ...] = (LIBRARY,)) -> None:
    """Add task ``name`` (ValueError when the name is taken or ``target`` is not ``"module:Class"``)."""
    if name in REGISTRY:
        raise ValueError(f"task {name!r} is already registered ({REGISTRY[name].target})")
    if target.count(":") != 1 or not all(target.split(":")):
        raise ValueError(f"task {name!r}: {target!r} is not 'module:Class'")
    if not runs_on or set(runs_on) - {LIBRARY, SERVED}:
        raise ValueError(f"task {name!r}: runs_on {runs_on!r} is not a choice of {LIBRARY!r} and {SERVED!r}")
    REGISTRY[name] = Entry(target, tuple(runs_on))


def names(runs_on: str = LIBRARY) -> tuple[str, ...]:
    """The registered tasks that run on ``runs_on``, in registration order."""
    return tuple(name for name, entry in REGISTRY.items() if runs_on in entry.runs_on)


def task_class(name: str, runs_on: str = LIBRARY) -> type:
    """The class of task ``name``, imported now; ConfigError for a name not registered for ``runs_on``."""
    entry = REGISTRY.get(name)
    if entry is None or runs_on not in entry.runs_on:
        from kvhub.errors import ConfigError

        where = "" if entry is None else f" ({name} runs on: {', '.join(entry.runs_on)})"
        raise ConfigError(f"unknown task {name!r} for {runs_on}{where}; use one of {', '.join(names(runs_on))}")
    module, _, cls = entry.target.partition(":")
    return getattr(importlib.import_module(module), cls)


RULER_TASKS = ("niah-multikey", "vt", "cwe")  # kvhub.eval.ruler
AGG_TASKS = ("agg-count", "agg-mode", "agg-total", "agg-order")  # kvhub.eval.aggregate
LONG_TASKS = ("facts", "multiturn", "code", "followup") + RULER_TASKS + AGG_TASKS
GIST_KINDS = ("chat", "document", "code")
GIST_TASKS = tuple(f"gist-{kind}" for kind in GIST_KINDS)
GIST_SUITE_TASKS = ("gist", "gist-dev")  # the suite of kvhub.eval.gist_suite: test split / dev split

for _name in MC_TASKS:
    register(_name, "kvhub.eval.taskeval:ChoiceTask")
register("ppl", "kvhub.eval.perplexity:PerplexityTask")
for _name in LONG_TASKS:  # the follow-up's second turn is scored in the library only
    if _name == "followup":
        register(_name, "kvhub.eval.recall_tasks:FollowupTask")
    else:
        register(_name, "kvhub.eval.recall_tasks:RecallTask", runs_on=(LIBRARY, SERVED))
for _name in GIST_TASKS:
    register(_name, "kvhub.eval.gist:GistTask", runs_on=(LIBRARY, SERVED))
for _name in GIST_SUITE_TASKS:
    register(_name, "kvhub.eval.gist_suite:SuiteTask")
register("turns", "kvhub.eval.served_turns:TurnsTask", runs_on=(SERVED,))  # timed turns: through kvhub serve only
del _name

TASKS = names(LIBRARY)
SERVED_LONG_TASKS = tuple(t for t in LONG_TASKS if SERVED in REGISTRY[t].runs_on)
SERVED_TURN_TASKS = ("turns",)
SERVED_TASKS = names(SERVED)

__all__ = [
    "AGG_TASKS",
    "GIST_KINDS",
    "GIST_SUITE_TASKS",
    "GIST_TASKS",
    "LIBRARY",
    "LONG_TASKS",
    "MC_TASKS",
    "REGISTRY",
    "RULER_TASKS",
    "SERVED",
    "SERVED_LONG_TASKS",
    "SERVED_TASKS",
    "SERVED_TURN_TASKS",
    "TASKS",
    "names",
    "register",
    "task_class",
]
