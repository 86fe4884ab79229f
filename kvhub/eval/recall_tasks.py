"""The long-context tasks ``kvhub eval`` runs (:class:`kvhub.eval.run.Task`): items by name, and the task classes.

:func:`build_items` makes the items of any long-context task of :data:`kvhub.eval.catalog.LONG_TASKS` (facts,
multiturn, code: :mod:`kvhub.eval.longctx`; RULER-style: :mod:`kvhub.eval.ruler`; aggregation: :mod:`kvhub.eval.aggregate`; the follow-up turn:
:mod:`kvhub.eval.followup`).  :class:`RecallTask` scores them through a :class:`kvhub.eval.conditions.Conditions`
backend (``kvhub eval`` and ``kvhub eval-serve`` alike), :class:`FollowupTask` with
:func:`kvhub.eval.followup.score_followup_item` (library only).
"""

from __future__ import annotations

import functools

from kvhub.errors import ConfigError
from kvhub.eval.catalog import AGG_TASKS, LONG_TASKS, RULER_TASKS
from kvhub.eval.conditions import library
from kvhub.eval.followup import FOLLOWUP_CONDITIONS, FOLLOWUP_PAIRS, followup_items, score_followup_item
from kvhub.eval.longctx import (
    RecallItem,
    RecallScore,
    code_items,
    fact_items,
    filler_paragraphs,
    multiturn_items,
    summarize_recall,
)
from kvhub.eval.ruler import ruler_items


def build_items(
    task: str, tokenizer, *, context_tokens: int, n: int, seed: int = 0, filler: list[str] | None = None
) -> list[RecallItem]:
    """``n`` seeded items of the long-context ``task`` of about ``context_tokens`` tokens."""
    if task not in LONG_TASKS:
        raise ConfigError(f"unknown long-context task {task!r}; use one of {', '.join(LONG_TASKS)}")
    if context_tokens < 64:
        raise ConfigError(f"--context-tokens must be at least 64, got {context_tokens}")
    if task == "code":
        return code_items(tokenizer, context_tokens=context_tokens, n=n, seed=seed)
    if task in AGG_TASKS:  # logs of their own: no filler
        from kvhub.eval.aggregate import aggregate_items

        return aggregate_items(task, tokenizer, context_tokens=context_tokens, n=n, seed=seed)
    filler = filler if filler is not None else filler_paragraphs(seed=seed)
    if task in RULER_TASKS:
        return ruler_items(task, tokenizer, filler, context_tokens=context_tokens, n=n, seed=seed)
    builder = {"facts": fact_items, "multiturn": multiturn_items, "followup": followup_items}[task]
    return builder(tokenizer, filler, context_tokens=context_tokens, n=n, seed=seed)


class RecallTask:
    """A long-context task at one length, as :func:`kvhub.eval.run.run_task` runs it (:class:`kvhub.eval.run.Task`),
    scored through ``conditions`` (:class:`kvhub.eval.conditions.Conditions`: the library handoff or a served
    pair); in the library the control map is scored beside every variant, with the same recompute.
    ``items``: these instead of ``limit`` built ones."""

    def __init__(self, task: str, conditions, *, context_tokens: int, limit: int, seed: int = 0, items=None):
        self.task, self.conditions, self.context_tokens, self.limit, self.seed = (
            task,
            conditions,
            context_tokens,
            limit,
            seed,
        )
        self.name = f"{task}-{context_tokens}"
        self._items = items
        self.read_score = conditions.read_recall

    @classmethod
    def tasks(cls, name: str, conditions, options) -> list:
        """One task per length of ``options`` (:class:`kvhub.eval.conditions.TaskOptions`)."""
        return [
            cls(name, conditions, context_tokens=length, limit=options.limit, seed=options.seed)
            for length in options.context_tokens
        ]

    def items(self) -> list[RecallItem]:
        if self._items is not None:
            return list(self._items)
        items = build_items(
            self.task, self.conditions.tokenizer, context_tokens=self.context_tokens, n=self.limit, seed=self.seed
        )
        longest_answer = max((len(item.answer_ids) for item in items), default=0)
        self.conditions.check_items(items, extra=longest_answer, context_tokens=self.context_tokens)
        return items

    def score(self, item: RecallItem, variants) -> list:
        return self.conditions.recall(item, list(variants))

    def summarize(self, scores: list) -> dict:
        return self.conditions.summarize_recall(
            scores, seed=self.seed, task=self.task, context_tokens=self.context_tokens
        )

    def record(self, variant: str, item: RecallItem, score) -> dict:
        return self.conditions.recall_record(self.name, variant, item, score)

    def dataset(self, items) -> dict:
        from kvhub.eval.results import items_sha256

        return {
            "name": self.name,
            "origin": f"built by kvhub.eval.longctx (seed {self.seed})",
            "context_tokens": self.context_tokens,
            "n": len(items),
            "sha256": items_sha256(items),
        }


class FollowupTask(RecallTask):
    """The follow-up turn at one length, as :func:`kvhub.eval.run.run_task` runs it (library only)."""

    def __init__(self, task: str, conditions, *, context_tokens: int, limit: int, seed: int = 0, items=None):
        conditions = library(conditions)  # the second turn is scored in this process only
        super().__init__(task, conditions, context_tokens=context_tokens, limit=limit, seed=seed, items=items)
        self.read_score = functools.partial(RecallScore.from_record, conditions=FOLLOWUP_CONDITIONS)

    def score(self, item: RecallItem, variants) -> list[RecallScore]:
        return score_followup_item(item, variants=list(variants), **self.conditions.models())

    def summarize(self, scores: list[RecallScore]) -> dict:
        """summarize_recall over every item, and again (keys prefixed ``missed_``) over the items whose room
        number turn 1's selection did not hold: the follow-ups proper."""
        summary = summarize_recall(scores, seed=self.seed, pairs=FOLLOWUP_PAIRS)
        shares = [s.meta["room_in_r1"] for s in scores if s.meta.get("room_in_r1") is not None]
        summary["room_in_r1"] = sum(shares) / len(shares) if shares else float("nan")
        missed = [s for s in scores if (s.meta.get("room_in_r1") or 0.0) < 1.0]
        if missed:
            subset = summarize_recall(missed, seed=self.seed, pairs=FOLLOWUP_PAIRS)
            summary.update(
                {
                    f"missed_{key}": value
                    for key, value in subset.items()
                    if key.startswith(("n", "acc_")) or "_minus_" in key
                }
            )
        return summary
