"""``kvhub eval --task ppl``: perplexity of the handoff on fixed token windows, as a task of :mod:`kvhub.eval.run`.

The windows are cut from a fixed text set (:mod:`kvhub.eval.textsets`; the same windows for every
mapper of a model pair) or from a calibration set's held-out split (``calib``: the mapper's own sequence
count and length, so that split is the one it was fitted beside).  Each window is one item: its first
half is the (mapped) context, its second half is scored (:func:`kvhub.eval.continuation.window_sample`),
under every recompute variant, selective ones included.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhub.eval.continuation import aggregate, window_sample


@dataclass
class Window:
    """One window of token ids; ``id`` is its index in the stream."""

    id: int
    ids: list[int]


class WindowScore(dict):
    """:func:`window_sample`'s figures of one window under one variant (a dict that is its own record)."""

    def as_dict(self) -> dict:
        return dict(self)


class PerplexityTask:
    """Perplexity on ``limit`` windows of ``seq_len`` tokens (:class:`kvhub.eval.run.Task`)."""

    def __init__(self, loaded, *, limit: int, text: str = "lambada", seq_len: int = 256, calib: str | None = None):
        self.loaded, self.limit, self.text, self.seq_len, self.calib = loaded, limit, text, seq_len, calib
        self._windows, self._dataset = self._read()
        self.name = f"ppl:{self._dataset['name']}/{self._dataset['seq_len']}"
        self.read_score = WindowScore

    @classmethod
    def tasks(cls, name: str, conditions, options) -> list:
        """The task over :class:`kvhub.eval.conditions.LibraryConditions` (the library only: log-likelihoods)."""
        from kvhub.eval.conditions import library

        loaded = library(conditions).loaded
        return [
            cls(
                loaded, limit=options.limit, text=options.ppl_text, seq_len=options.ppl_seq_len, calib=options.ppl_calib
            )
        ]

    def _read(self):
        from kvhub.eval.textsets import windows_sha256

        held, dataset = self._calibration_windows() if self.calib is not None else self._text_windows()
        dataset.update(
            n=int(held.shape[0]),
            seq_len=int(held.shape[1]),
            context_len=int(held.shape[1]) // 2,
            sha256=windows_sha256(held),
        )
        return [Window(index, row.tolist()) for index, row in enumerate(held)], dataset

    def _text_windows(self):
        from kvhub.eval.textsets import load_text_set, token_windows

        text_set = load_text_set(self.text)
        held = token_windows(text_set, self.loaded.tokenizer, windows=self.limit, seq_len=self.seq_len)
        return held, {"name": text_set.name, "source": text_set.source, "text_sha256": text_set.sha256}

    def _calibration_windows(self):
        from kvhub.calib import resolve_calibration

        mapper = self.loaded.mapper
        calibration = mapper.metadata.get("calibration", {})
        built = resolve_calibration(
            self.calib,
            tokenizer=self.loaded.tokenizer,
            tokenizer_id=mapper.source["model_id"],
            samples=calibration.get("sequences"),
            seq_len=calibration.get("seq_len"),
        )
        held = built.heldout[: max(1, min(self.limit, built.heldout.shape[0]))]
        return held, {
            "name": f"calibration:{built.name}",
            "origin": "held-out split of a calibration set",
            "calibration_sha256": built.content_hash,
        }

    def items(self) -> list[Window]:
        return self._windows

    def score(self, window: Window, variants) -> list[WindowScore]:
        import torch

        loaded = self.loaded
        ids = torch.tensor([window.ids])
        return [
            WindowScore(
                window_sample(
                    loaded.mapper,
                    loaded.source,
                    loaded.target,
                    ids,
                    context_len=self._dataset["context_len"],
                    recompute=spec,
                    tokenizer=loaded.tokenizer,
                )
            )
            for spec in variants
        ]

    def summarize(self, scores: list[WindowScore]) -> dict:
        metrics = aggregate([dict(s) for s in scores])
        return {"n": metrics.sequences, **metrics.as_dict()}

    def record(self, variant: str, window: Window, score: WindowScore) -> dict:
        from kvhub.eval.results import window_record

        return window_record(self.name, variant, {"index": window.id, **score})

    def dataset(self, items) -> dict:
        return dict(self._dataset)
