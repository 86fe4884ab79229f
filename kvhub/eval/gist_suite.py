"""``kvhub eval --task gist`` (test split) / ``gist-dev``: the gist suite of :mod:`kvhub.eval.suite_items` through
the one evaluation loop (:func:`kvhub.eval.run.run_task`), each domain reported alone and pooled.

One task per context length; its items are ``limit`` per domain, each with its wrong document (the next item the
same domain's generator builds, as :class:`kvhub.eval.gist.GistTask` does), scored by the backend's ``gist``
(:func:`kvhub.eval.gist.score_gist_item` in the library: own / mapped / drop / control / wrong / zero / raw /
floor, and the keyed answer where the item has one).  The summary is :func:`kvhub.eval.gist.summarize_gist` over
every item (pooled: the ratio of the mean NLLs over all domains' items, so domains with a wider gap weigh more;
the paired intervals resample items), with ``domains``: the same summary per domain.
"""

from __future__ import annotations

from kvhub.errors import CorpusUnavailableError
from kvhub.eval.gist import ANSWER_TOKENS, GistItem
from kvhub.eval.gist_controls import with_wrong_documents
from kvhub.eval.suite_items import DOMAINS, suite_items

SUITE_TASKS = {"gist": "test", "gist-dev": "dev"}  # task name -> the split it reads


def check_corpora(domains=DOMAINS) -> None:
    """Read every corpus ``domains`` need (kept for the build); one CorpusUnavailableError naming each missing
    one and what fetches it, so ``kvhub eval`` refuses before any model loads."""
    from kvhub.eval.suite_corpora import CORPORA
    from kvhub.eval.suite_items import CORPUS_OF

    missing = []
    for corpus in dict.fromkeys(CORPUS_OF[d] for d in domains if d in CORPUS_OF):
        try:
            CORPORA[corpus]()
        except CorpusUnavailableError as exc:
            missing.append(f"{corpus}: {exc}")
    if missing:
        raise CorpusUnavailableError("the gist suite cannot read every corpus here:\n  " + "\n  ".join(missing))


def build_suite(tokenizer, *, split: str, context_tokens: int, per_domain: int, seed: int = 0, domains=DOMAINS):
    """``per_domain`` items of each domain with their wrong documents, domain after domain (:func:`check_corpora`
    first: every missing corpus named at once)."""
    check_corpora(domains)
    items = []
    for domain in domains:
        built = suite_items(domain, tokenizer, split=split, context_tokens=context_tokens, n=per_domain + 1, seed=seed)
        items += with_wrong_documents(built[:per_domain], built[1:])
    return items


class SuiteTask:
    """The gist suite at one context length (:class:`kvhub.eval.run.Task`), through ``conditions``
    (:class:`kvhub.eval.conditions.Conditions`); ``items``: these instead of built ones."""

    def __init__(self, task: str, conditions, *, context_tokens: int, limit: int, seed: int = 0, items=None):
        self.task, self.split = task, SUITE_TASKS[task]
        self.conditions, self.context_tokens, self.limit, self.seed = conditions, context_tokens, limit, seed
        self.name = f"{task}-{context_tokens}"
        self._items = items
        self.read_score = conditions.read_gist

    @classmethod
    def tasks(cls, name: str, conditions, options) -> list:
        """One task per length of ``options``; ``limit`` is the items per domain."""
        return [
            cls(name, conditions, context_tokens=length, limit=options.limit, seed=options.seed)
            for length in options.context_tokens
        ]

    def items(self) -> list[GistItem]:
        if self._items is not None:
            return list(self._items)
        items = build_suite(
            self.conditions.tokenizer,
            split=self.split,
            context_tokens=self.context_tokens,
            per_domain=self.limit,
            seed=self.seed,
        )
        self.conditions.check_items(items, extra=ANSWER_TOKENS, context_tokens=self.context_tokens)
        return items

    def score(self, item: GistItem, variants) -> list:
        return self.conditions.gist(item, list(variants))

    def summarize(self, scores: list) -> dict:
        def summary(subset):
            return self.conditions.summarize_gist(
                subset, seed=self.seed, task=self.task, context_tokens=self.context_tokens
            )

        domains = sorted({s.meta.get("domain", "") for s in scores}, key=_domain_order)
        out = summary(scores)
        out["domains"] = {d: summary([s for s in scores if s.meta.get("domain", "") == d]) for d in domains}
        return out

    def record(self, variant: str, item: GistItem, score) -> dict:
        return self.conditions.gist_record(self.name, variant, item, score)

    def dataset(self, items) -> dict:
        from kvhub.eval.results import items_sha256

        return {
            "name": self.name,
            "origin": f"built by kvhub.eval.suite_items ({self.split} split, seed {self.seed})",
            "context_tokens": self.context_tokens,
            "n": len(items),
            "split": self.split,
            "domains": {d: sum(i.meta.get("domain") == d for i in items) for d in DOMAINS},
            "sha256": items_sha256(items),
        }


def _domain_order(domain: str) -> int:
    return DOMAINS.index(domain) if domain in DOMAINS else len(DOMAINS)
