"""The gist suite's items: six domains of text no item generator of kvhub's tuned, each a context and a question
about all of it, split into dev and test by source document.

Domains (the corpora: :mod:`kvhub.eval.suite_corpora`):

- ``chat``:         two people's chats over several days (chitchat conversations, the two speakers named);
                    "what did they talk about, and what changed from the first day to the last";
- ``multiparty``:   a group chat of 4-6 named people, two or three chitchat conversations interleaved in
                    bursts (more between the same people where those do not fill the context); keyed: **who
                    wrote the most messages** (a margin of at least 2 and 20% over the next, counted after
                    the crop);
- ``licence``:      SPDX licence texts; "what do the terms permit, require and disclaim";
- ``manpage``:      Debian manual pages of sections 5 and 7 (file formats, overviews); "what do they describe";
- ``code``:         Python files of installed packages no calibration set reads; "what does the code do";
- ``instructions``: a long numbered procedure (seeded templates: steps, each with one tool, and notes), then
                    the question; keyed: **which tool the most steps use** (a margin of at least 2).

A source document's split is fixed by a hash of ``corpus:doc_id`` (:func:`split_of`: a third dev, the rest
test): the same on every machine, disjoint by document, the same for every seed and length, and the same for a
conversation in ``chat`` and in ``multiparty``.  Choose on ``dev``; report on ``test``.  Items are seeded
(``seed``, domain, split and length name the generator).  These builders feed evaluation only: nothing under
:mod:`kvhub.fitting` may import them (tests/eval/test_gist_suite.py checks it).
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections import Counter
from collections.abc import Callable

from kvhub.errors import ConfigError
from kvhub.eval.gist import GistItem, _templated
from kvhub.eval.suite_corpora import CORPORA, SourceDoc

DOMAINS = ("chat", "multiparty", "licence", "manpage", "code", "instructions")
SPLITS = ("dev", "test")
CORPUS_OF = {"chat": "chitchat", "multiparty": "chitchat", "licence": "spdx", "manpage": "manpages", "code": "code"}
NAMES = ("Anna", "Ben", "Chloe", "David", "Elena", "Farid", "Grace", "Hugo", "Iris", "Jonas", "Kira", "Liam")
MIN_PART = 48  # tokens: a shorter remainder ends the context rather than start another document
MAX_THREADS = 64  # conversations in one group chat at the most (a 4k context took 2-8 chitchat conversations)
TOOLS = ("hammer", "wrench", "scanner", "ladder", "drill", "brush", "clamp", "torch")
QUESTIONS = {
    "chat": "Summarize what {a} and {b} talked about over these days, and how their conversation changed from the "
    "first day to the last.",
    "multiparty": "Who wrote the most messages in this group chat? Start your answer with that person's name, then "
    "say briefly what the group talked about.",
    "licence": "Summarize the licence terms above: what they permit, what they require, and what they disclaim.",
    "manpage": "Summarize what the manual pages above describe, in a few sentences.",
    "code": "Explain what the code above does: its main classes and functions, and how they work together.",
    "instructions": "Which tool do the instructions above use in the most steps? Start your answer with the tool's "
    "name, then summarize the procedure briefly.",
}


def split_of(corpus: str, doc_id: str) -> str:
    """``dev`` for a third of the documents, ``test`` for the rest, by sha256 of ``corpus:doc_id``."""
    digest = hashlib.sha256(f"{corpus}:{doc_id}".encode()).digest()
    return "dev" if digest[0] % 3 == 0 else "test"


def suite_items(
    domain: str, tokenizer, *, split: str, context_tokens: int, n: int, seed: int = 0, docs=None
) -> list[GistItem]:
    """``n`` items of ``domain`` of about ``context_tokens`` tokens from the ``split`` documents (``docs``: these
    instead of the domain's corpus, split the same way).  CorpusUnavailableError when the corpus is not
    on this machine; ConfigError for an unknown domain or split, or too few documents."""
    if domain not in DOMAINS:
        raise ConfigError(f"unknown gist-suite domain {domain!r}; use one of {', '.join(DOMAINS)}")
    if split not in SPLITS:
        raise ConfigError(f"unknown split {split!r}; use dev or test")
    rng = random.Random(f"gist-suite-{domain}-{split}-{seed}-{context_tokens}")
    if domain == "instructions":
        pool = (i for i in itertools.count() if split_of("instructions", f"procedure-{i}") == split)
        built = [_instructions(next(pool), tokenizer, context_tokens, seed=seed) for _ in range(n)]
    else:
        corpus = CORPUS_OF[domain]
        docs = [doc for doc in (CORPORA[corpus]() if docs is None else docs) if split_of(corpus, doc.doc_id) == split]
        if len(docs) < 4:
            raise ConfigError(f"the {domain} domain has {len(docs)} {split} documents; it needs at least 4")
        draw = _Drawer(list(docs), rng)
        builder = _BUILDERS[domain]
        built = [builder(draw, rng, tokenizer, context_tokens) for _ in range(n)]
    items = []
    for i, (messages, meta) in enumerate(built):
        prompt = _templated(tokenizer, messages)
        key = meta.get("key")
        # the key as a reply starts with it (capitalised): the tokens greedy decoding must write
        key_ids = _key_ids(tokenizer, messages, key[:1].upper() + key[1:]) if key else None
        meta = {**meta, "domain": domain, "split": split, "context_tokens": len(prompt)}
        items.append(GistItem(f"gist-{split}-{domain}-{context_tokens}-{i}", prompt, meta, key=key, key_ids=key_ids))
    return items


class _Drawer:
    """Documents in a seeded order, each used once before any is used again."""

    def __init__(self, docs: list[SourceDoc], rng: random.Random):
        self.docs, self.rng, self.queue = docs, rng, []

    def __call__(self) -> SourceDoc:
        if not self.queue:
            self.queue = list(self.docs)
            self.rng.shuffle(self.queue)
        return self.queue.pop()


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _fill_lines(lines: list[str], tokenizer, budget: int) -> tuple[list[str], int]:
    """The first of ``lines`` whose tokens (each line + its newline) stay within ``budget``; (kept, tokens)."""
    kept, used = [], 0
    for line in lines:
        cost = _count(tokenizer, line) + 1
        if used + cost > budget and kept:
            break
        kept.append(line)
        used += cost
    return kept, used


def _document_prompt(draw, tokenizer, context_tokens: int, question: str, *, label: Callable[[SourceDoc], str]):
    """Documents drawn until ``context_tokens``, the last cropped at a line; one user message with the question."""
    parts, ids, used = [], [], 0
    while used < context_tokens - MIN_PART or not parts:
        doc = draw()
        lines, cost = _fill_lines([label(doc)] + doc.text.splitlines(), tokenizer, context_tokens - used)
        parts.append("\n".join(lines))
        ids.append(doc.doc_id)
        used += cost + 1
    content = "\n\n".join(parts) + "\n\n" + question
    return [{"role": "user", "content": content}], {"docs": ids}


def _licence(draw, rng, tokenizer, context_tokens):
    return _document_prompt(draw, tokenizer, context_tokens, QUESTIONS["licence"], label=lambda doc: "----")


def _manpage(draw, rng, tokenizer, context_tokens):
    return _document_prompt(draw, tokenizer, context_tokens, QUESTIONS["manpage"], label=lambda doc: "----")


def _code(draw, rng, tokenizer, context_tokens):
    return _document_prompt(
        draw, tokenizer, context_tokens, QUESTIONS["code"], label=lambda doc: f"# file: {doc.doc_id.split('/', 1)[-1]}"
    )


def _chat(draw, rng, tokenizer, context_tokens):
    a, b = rng.sample(NAMES, 2)
    lines, ids, day = [], [], 0
    used = 0
    while used < context_tokens - MIN_PART or not lines:
        doc = draw()
        day += 1
        said = [f"Day {day}"] + [f"{a if s == 'A' else b}: {text}" for s, text in doc.messages]
        kept, cost = _fill_lines(said, tokenizer, context_tokens - used)
        if len(kept) < 2:  # a day's heading alone: the budget is spent
            break
        lines += kept + [""]
        ids.append(doc.doc_id)
        used += cost + 1
    content = f"A chat between {a} and {b}:\n\n" + "\n".join(lines) + "\n" + QUESTIONS["chat"].format(a=a, b=b)
    return [{"role": "user", "content": content}], {"docs": ids}


def _multiparty(draw, rng, tokenizer, context_tokens, *, tries: int = 50):
    for _ in range(tries):
        threads = [draw() for _ in range(rng.choice((2, 3)))]
        names = rng.sample(NAMES, 2 * len(threads))
        pairs = [(names[2 * t], names[2 * t + 1]) for t in range(len(threads))]
        # a long context: more conversations between members of the same group, until their lines fill it (the
        # draws come after the group's names, so a context the first two or three fill is built as before)
        written = sum(_thread_tokens(tokenizer, doc, pair) for doc, pair in zip(threads, pairs))
        while written < context_tokens and len(threads) < MAX_THREADS:
            threads.append(draw())
            pairs.append(tuple(rng.sample(names, 2)))
            written += _thread_tokens(tokenizer, threads[-1], pairs[-1])
        queues = [[(pairs[t][s == "B"], text) for s, text in doc.messages] for t, doc in enumerate(threads)]
        said = []
        while any(queues):
            queue = rng.choice([q for q in queues if q])
            burst = rng.randint(1, 4)
            said += queue[:burst]
            del queue[:burst]
        kept, _ = _fill_lines([f"{name}: {text}" for name, text in said], tokenizer, context_tokens)
        counts = Counter(line.split(":", 1)[0] for line in kept).most_common()
        if len(counts) > 1 and counts[0][1] - counts[1][1] >= max(2, 0.2 * counts[0][1]):
            content = "A group chat:\n\n" + "\n".join(kept) + "\n\n" + QUESTIONS["multiparty"]
            meta = {"docs": [doc.doc_id for doc in threads], "key": counts[0][0], "counts": dict(counts)}
            return [{"role": "user", "content": content}], meta
    raise ConfigError(f"no group chat with a clear most active writer in {tries} tries; use another --seed")


def _thread_tokens(tokenizer, doc: SourceDoc, pair: tuple[str, str]) -> int:
    """Tokens of a conversation's lines in the group chat, as :func:`_fill_lines` counts them (``pair``: the
    names of its speakers A and B)."""
    return sum(_count(tokenizer, f"{pair[s == 'B']}: {text}") + 1 for s, text in doc.messages)


_ACTIONS = ("check", "tighten", "clean", "inspect", "adjust", "measure", "secure", "mark")
_OBJECTS = ("the valve", "the left panel", "the pump housing", "the cable tray", "the filter", "the door hinge")
_NOTES = (
    "Note: wear gloves while doing this.",
    "Write the time of this step in the log.",
    "If anything looks damaged, stop and call the supervisor.",
    "Keep the work area clear of loose parts.",
    "Do not skip this step even when the previous check passed.",
)


def _instructions(index: int, tokenizer, context_tokens: int, *, seed: int):
    """Procedure ``index`` (seeded by it and ``seed``): numbered steps until ``context_tokens``, the key counted
    over them."""
    rng = random.Random(f"procedure-{index}-{seed}")
    tools = rng.sample(TOOLS, 4)
    weights = [4, 2, 2, 1]
    lines, used, step = ["Maintenance procedure. Follow every step in order."], 0, 0
    while used < context_tokens:
        step += 1
        tool = rng.choices(tools, weights)[0]
        line = f"Step {step}: {rng.choice(_ACTIONS)} {rng.choice(_OBJECTS)} with the {tool}."
        if rng.random() < 0.5:
            line += " " + rng.choice(_NOTES)
        lines.append(line)
        used += _count(tokenizer, line) + 1
    counts = Counter(line.rsplit("with the ", 1)[1].split(".")[0] for line in lines[1:]).most_common()
    while len(counts) > 1 and counts[0][1] - counts[1][1] < 2:  # widen the margin: the leader takes a step
        second = counts[1][0]
        victim = next(i for i in range(len(lines) - 1, 0, -1) if f"with the {second}." in lines[i])
        lines[victim] = lines[victim].replace(f"with the {second}.", f"with the {counts[0][0]}.")
        counts = Counter(line.rsplit("with the ", 1)[1].split(".")[0] for line in lines[1:]).most_common()
    content = "\n".join(lines) + "\n\n" + QUESTIONS["instructions"]
    meta = {"docs": [f"procedure-{index}"], "key": counts[0][0], "counts": dict(counts)}
    return [{"role": "user", "content": content}], meta


def _key_ids(tokenizer, messages, key: str) -> list[int]:
    """The tokens the keyed answer adds right after the prompt (templated and tokenised together).  The caller
    passes the key as a reply starts with it: "Hammer", not "hammer" (the target's own "Hammer - the instructions
    use the hammer in 17 steps" was scored wrong while the key was lower case)."""
    from kvhub.eval.longctx import _answer_ids

    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return _answer_ids(tokenizer, text, key)


_BUILDERS = {"chat": _chat, "multiparty": _multiparty, "licence": _licence, "manpage": _manpage, "code": _code}
