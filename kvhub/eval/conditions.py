"""Where a task's conditions run: the :class:`Conditions` contract, the library backend and the task options.

A task (:class:`kvhub.eval.run.Task`) builds its items and asks a backend to score each one under the
conditions of :data:`kvhub.eval.longctx.LONG_CONDITIONS` (``own`` / ``mapped`` / ``control`` / ``source`` /
``floor``, and ``drop`` where the backend can; the gist adds the ``wrong``, ``zero`` and (where the shapes allow)
``raw`` controls of :mod:`kvhub.eval.gist_controls` in the library); it never knows where the models run.  Two backends:

- :class:`LibraryConditions` (``kvhub eval``): the handoff in this process, over a
  :class:`kvhub.eval.run.LoadedVersion`; one score per recompute variant, cached per item.
- :class:`kvhub.eval.served_conditions.ServedConditions` (``kvhub eval-serve``): requests to a running
  ``kvhub serve`` pair; one configuration (what the large server was started with), so its only variant is
  ``None``, and nothing is cached (the servers do not say which mapper they run).

:func:`kvhub.eval.run.run_task` is the one loop over items for both.  A task that needs one backend's own
means (multiple choice's log-likelihoods, the served turns' timings) reads them from that backend and is
registered for it alone (:mod:`kvhub.eval.catalog`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class TaskOptions:
    """What a task class is built from (``tasks(name, conditions, options)``): items per task and length
    (``limit``), the seed, the long-context lengths, perplexity's text, and multiple-choice items already read."""

    limit: int
    seed: int = 0
    context_tokens: tuple[int, ...] = (1024,)
    ppl_text: str = "lambada"
    ppl_seq_len: int = 256
    ppl_calib: str | None = None
    items: dict = field(default_factory=dict)  # task name -> items already read (multiple choice)


class Conditions(Protocol):
    """The contract a task scores through: an item under own / mapped / control / floor (/ source / drop) ->
    one score per variant, with what the transfer reported; and how those scores are summarized and logged.

    ``kind``: ``"library"`` or ``"served"`` (:data:`kvhub.eval.catalog.LIBRARY` / ``SERVED``); ``tokenizer``
    builds the items.  ``recall*``: exact answers (:class:`kvhub.eval.longctx.RecallItem`); ``gist*``:
    teacher-forced mean NLL of the large model's own answer (:class:`kvhub.eval.gist.GistItem`).  ``summarize_*``
    get the task's name (``facts``) and requested length for the fields a backend adds; ``read_*`` turn a cached
    ``as_dict()`` back into a score (None: this backend's scores are not cached).
    """

    kind: str
    tokenizer: Any
    read_recall: Any
    read_gist: Any

    def check_items(self, items: list, *, extra: int, context_tokens: int) -> None: ...

    def recall(self, item, variants: list) -> list: ...

    def summarize_recall(self, scores: list, *, seed: int, task: str, context_tokens: int) -> dict: ...

    def recall_record(self, name: str, variant: str, item, score) -> dict: ...

    def gist(self, item, variants: list) -> list: ...

    def summarize_gist(self, scores: list, *, seed: int, task: str, context_tokens: int) -> dict: ...

    def gist_record(self, name: str, variant: str, item, score) -> dict: ...


class LibraryConditions:
    """The handoff in this process (``kvhub eval``): ``loaded`` (:class:`kvhub.eval.run.LoadedVersion`, or anything
    with ``mapper``, ``source``, ``target`` and ``tokenizer``), with its control map built once."""

    kind = "library"

    def __init__(self, loaded):
        from kvhub.eval.gist import GIST_CONDITIONS, read_gist_score
        from kvhub.eval.longctx import LONG_CONDITIONS, RecallScore

        self.loaded, self.tokenizer = loaded, loaded.tokenizer
        self.judges = bool(getattr(self.tokenizer, "chat_template", None))  # the target judges: a chat model only
        self.read_recall = functools.partial(RecallScore.from_record, conditions=LONG_CONDITIONS)
        self.read_gist = functools.partial(
            read_gist_score, required=(*GIST_CONDITIONS, "zero"), generated=True, judged=self.judges
        )

    @functools.cached_property
    def control(self):
        """The no-information control map (:mod:`kvhub.core.control`) of the loaded mapper."""
        from kvhub.core.control import control_mapper

        return control_mapper(self.loaded.mapper)

    @functools.cached_property
    def zero(self):
        """The all-zero control map (:func:`kvhub.eval.gist_controls.zero_mapper`): the gist's ``zero`` condition."""
        from kvhub.eval.gist_controls import zero_mapper

        return zero_mapper(self.control)

    @functools.cached_property
    def raw(self):
        """The raw-source-cache control (:func:`kvhub.eval.gist_controls.raw_source_map`), None where the two
        models' caches differ in shape."""
        from kvhub.eval.gist_controls import raw_source_map

        return raw_source_map(self.loaded.mapper, self.loaded.source.config, self.loaded.target.config)

    def models(self) -> dict:
        """The keywords every library scorer takes: both maps, both models and the tokenizer."""
        loaded = self.loaded
        return {
            "mapper": loaded.mapper,
            "control": self.control,
            "source": loaded.source,
            "target": loaded.target,
            "tokenizer": loaded.tokenizer,
        }

    def check_items(self, items: list, *, extra: int, context_tokens: int) -> None:
        from kvhub.eval.longctx import check_positions

        check_positions(items, (self.loaded.source, self.loaded.target), extra=extra, context_tokens=context_tokens)

    def recall(self, item, variants: list) -> list:
        from kvhub.eval.longctx import score_recall_item

        return score_recall_item(item, variants=list(variants), **self.models())

    def summarize_recall(self, scores: list, *, seed: int, task: str, context_tokens: int) -> dict:
        from kvhub.eval.longctx import summarize_recall

        return summarize_recall(scores, seed=seed)

    def recall_record(self, name: str, variant: str, item, score) -> dict:
        from kvhub.eval.results import recall_record

        return recall_record(name, variant, item, score)

    def gist(self, item, variants: list) -> list:
        from kvhub.eval.gist import score_gist_item

        return score_gist_item(
            item, variants=list(variants), zero=self.zero, raw=self.raw, judged=self.judges, **self.models()
        )

    def summarize_gist(self, scores: list, *, seed: int, task: str, context_tokens: int) -> dict:
        from kvhub.eval.gist import summarize_gist

        return summarize_gist(scores, seed=seed)

    def gist_record(self, name: str, variant: str, item, score) -> dict:
        from kvhub.eval.gist import gap_closed, gen_gap_closed
        from kvhub.eval.gist_controls import GIST_CONTROLS

        closing = ("mapped", "drop", "control", *GIST_CONTROLS)

        return {
            "task": name,
            "variant": variant,
            "doc_id": item.id,
            "nll": score.nll,
            "answer": score.answer,
            "gap_closed": {c: gap_closed(score.nll, c) for c in closing if c in score.nll},
            "rouge": score.rouge,
            "gen_gap_closed": {c: gen_gap_closed(score.rouge, c) for c in closing if c in score.rouge},
            "written": {c: self.tokenizer.decode(ids, skip_special_tokens=True) for c, ids in score.written.items()},
            "judged": score.judged,
            "judge_gap_closed": {c: gen_gap_closed(score.judged, c) for c in closing if c in score.judged},
            "keyed": score.keyed,
            "meta": item.meta,
        }


def library(conditions) -> LibraryConditions:
    """``conditions`` as a LibraryConditions: a LoadedVersion is wrapped; served conditions are refused."""
    if isinstance(conditions, LibraryConditions):
        return conditions
    if getattr(conditions, "kind", None) == "served":
        from kvhub.errors import ConfigError

        raise ConfigError("this task runs in the library only (kvhub eval), not through kvhub serve")
    return LibraryConditions(conditions)
