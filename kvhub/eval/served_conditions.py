"""The served backend of :class:`kvhub.eval.conditions.Conditions`: a running ``kvhub serve`` pair over HTTP.

Exact answers are scored as :func:`kvhub.eval.served.score_served_item` sends them (five requests per item),
the gist as :func:`kvhub.eval.served_gist.score_served_gist_item` does (the large model's own answer, then
forced under each condition).  The pair has one configuration, whatever the large server was started with, so
the only variant is ``None``; nothing is cached (the servers do not say which mapper they run), and each
summary carries the task's name and requested length, as ``kvhub eval-serve``'s results document lists them.
"""

from __future__ import annotations

from kvhub.eval.served import AGREEMENT_TOKENS, Endpoint, score_served_item, served_record, summarize_served


class ServedConditions:
    """``small`` stores each prompt's KV, ``large`` maps it (:class:`kvhub.eval.served.Endpoint`); ``tokenizer``
    builds the prompts; ``agreement_tokens``: greedy tokens compared with own; ``answer_tokens``: the gist's."""

    kind = "served"
    read_recall = None  # served scores are not cached
    read_gist = None

    def __init__(
        self,
        small: Endpoint,
        large: Endpoint,
        tokenizer,
        *,
        agreement_tokens: int = AGREEMENT_TOKENS,
        answer_tokens: int | None = None,
    ):
        from kvhub.eval.gist import ANSWER_TOKENS

        self.small, self.large, self.tokenizer = small, large, tokenizer
        self.agreement_tokens = agreement_tokens
        self.answer_tokens = ANSWER_TOKENS if answer_tokens is None else answer_tokens

    @staticmethod
    def _one(variants: list) -> None:
        if list(variants) != [None]:
            from kvhub.errors import ConfigError

            raise ConfigError(
                "a served pair runs one configuration (variant None); recompute variants are kvhub eval's"
            )

    def check_items(self, items: list, *, extra: int, context_tokens: int) -> None:
        """ConfigError when an item's prompt plus ``extra`` tokens (its answer) is longer than a server's
        ``max_model_len`` (where its /models reports one), before any request is sent."""
        limits = [(e.max_model_len, name, e.url) for name, e in (("small", self.small), ("large", self.large))]
        known = [limit for limit in limits if limit[0] is not None]
        if not known or not items:
            return
        limit, name, url = min(known)
        longest = max(len(item.prompt_ids) for item in items) + extra
        if longest > limit:
            from kvhub.errors import ConfigError

            raise ConfigError(
                f"--context-tokens {context_tokens} builds prompts of up to {longest} tokens with their answers, past "
                f"the {name} server's max_model_len {limit} ({url}); use --context-tokens "
                f"{max(64, context_tokens - (longest - limit) - 16)} or less, or start the pair with a larger "
                "--max-model-len"
            )

    def recall(self, item, variants: list) -> list:
        self._one(variants)
        return [
            score_served_item(
                item,
                small=self.small,
                large=self.large,
                tokenizer=self.tokenizer,
                agreement_tokens=self.agreement_tokens,
            )
        ]

    def summarize_recall(self, scores: list, *, seed: int, task: str, context_tokens: int) -> dict:
        summary = summarize_served(scores, seed=seed)
        summary.update(task=task, requested_context_tokens=context_tokens, agreement_tokens=self.agreement_tokens)
        return summary

    def recall_record(self, name: str, variant: str, item, score) -> dict:
        return served_record(name, item, score)

    def gist(self, item, variants: list) -> list:
        from kvhub.eval.served_gist import score_served_gist_item

        self._one(variants)
        return [score_served_gist_item(item, small=self.small, large=self.large, answer_tokens=self.answer_tokens)]

    def summarize_gist(self, scores: list, *, seed: int, task: str, context_tokens: int) -> dict:
        from kvhub.eval.served_gist import summarize_served_gist

        summary = summarize_served_gist(scores, seed=seed)
        summary.update(task=task, requested_context_tokens=context_tokens, answer_tokens=self.answer_tokens)
        return summary

    def gist_record(self, name: str, variant: str, item, score) -> dict:
        from kvhub.eval.served_gist import served_gist_record

        return served_gist_record(name, item, score)


def run_served(task, *, log_samples: bool = False, seed: int = 0, limit: int = 0, progress=None) -> dict:
    """``task`` (built over :class:`ServedConditions`) through :func:`kvhub.eval.run.run_task`: its summary, with
    ``samples`` (the per-item records) when ``log_samples``."""
    from kvhub.eval.run import RunSettings, run_task

    settings = RunSettings(None, None, seed=seed, limit=limit, log_samples=log_samples)
    outcome = run_task(task, [None], settings=settings, progress=progress)
    summary = dict(outcome.summaries[""])
    if log_samples:
        summary["samples"] = outcome.records
    return summary
