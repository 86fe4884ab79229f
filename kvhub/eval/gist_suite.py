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
from kvhub.eval.gist import ANSWER_TOKENS, GistItem, GistTask
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


class SuiteTask(GistTask):
    """The gist suite at one context length: a :class:`~kvhub.eval.gist.GistTask` whose items are the suite's
    (``limit`` per domain, of the task's split) and whose summary adds each domain's; ``items``: these instead of
    built ones."""

    def __init__(self, task: str, conditions, *, context_tokens: int, limit: int, seed: int = 0, items=None):
        super().__init__(task, conditions, context_tokens=context_tokens, limit=limit, seed=seed, items=items)
        self.split = SUITE_TASKS[task]

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

    def summarize(self, scores: list) -> dict:
        domains = sorted({s.meta.get("domain", "") for s in scores}, key=_domain_order)
        summary = super().summarize
        out = summary(scores)
        out["domains"] = {d: summary([s for s in scores if s.meta.get("domain", "") == d]) for d in domains}
        return out

    def dataset(self, items) -> dict:
        return {
            **super().dataset(items),
            "origin": f"built by kvhub.eval.suite_items ({self.split} split, seed {self.seed})",
            "split": self.split,
            "domains": {d: sum(i.meta.get("domain") == d for i in items) for d in DOMAINS},
        }


def _domain_order(domain: str) -> int:
    return DOMAINS.index(domain) if domain in DOMAINS else len(DOMAINS)
