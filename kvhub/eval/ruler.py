"""RULER-style long-context tasks built offline, in kvpress's row format, scored as :mod:`kvhub.eval.longctx` scores.

Single-needle retrieval is easy for anything that keeps the tokens the question points at (a query-aware
selection finds them).  These tasks need more of the context than one span (RULER, Hsieh et al. 2024):

- ``niah-multikey``: :data:`NEEDLES` needles "One of the special magic numbers for {key} is: {7 digits}." at
  spread depths in filler prose; the question asks for one key's number, the others are decoys of the
  same shape;
- ``vt``: variable tracking.  A chain ``VAR A = 12345``, ``VAR B = VAR A``, ... of :data:`HOPS` assignments
  spread over the context, and a decoy chain with another value; the answer names every variable of the
  asked value's chain, in order;
- ``cwe``: common-words extraction, aggregation.  A numbered list of words in which :data:`COMMON` words
  recur (each a distinct number of times, the most frequent first) among words that occur once or twice;
  the answer lists the common words from the most frequent down.

Each item is a :class:`PressRow` (``context``, ``question``, ``answer_prefix``, ``answer``,
``max_new_tokens``: the columns of kvpress's datasets, so results can be set beside its presses) and
becomes a :class:`~kvhub.eval.longctx.RecallItem` whose prompt is context + question + answer_prefix.
"""

from __future__ import annotations

import random
import re
from dataclasses import asdict, dataclass

from kvhub.errors import ConfigError
from kvhub.eval.catalog import RULER_TASKS
from kvhub.eval.longctx import RecallItem, _answer_ids, _count, _haystack

NEEDLES = 4
HOPS = 4
COMMON = 3

_KEYS = (
    "harbour",
    "lantern",
    "compass",
    "falcon",
    "meadow",
    "quarry",
    "beacon",
    "willow",
    "cobalt",
    "summit",
    "granite",
    "orchard",
    "pepper",
    "saddle",
    "thimble",
    "anchor",
    "canyon",
    "dolphin",
    "ember",
    "fjord",
)


@dataclass
class PressRow:
    """One item in kvpress's dataset format (its evaluation/README.md)."""

    context: str
    question: str
    answer_prefix: str
    answer: str
    max_new_tokens: int

    def as_dict(self) -> dict:
        return asdict(self)


# ---- rows -------------------------------------------------------------------------------------------
def niah_multikey_row(
    tokenizer, filler: list[str], rng: random.Random, *, context_tokens: int, needles: int = NEEDLES
) -> PressRow:
    keys = rng.sample(_KEYS, needles)
    values = [str(rng.randrange(1_000_000, 10_000_000)) for _ in keys]
    sentences = [f"One of the special magic numbers for {key} is: {value}." for key, value in zip(keys, values)]
    asked = rng.randrange(needles)
    question = f"\n\nWhat is the special magic number for {keys[asked]} mentioned in the provided text?"
    prefix = f"\nAnswer: The special magic number for {keys[asked]} mentioned in the provided text is"
    depths = [(i + rng.uniform(0.2, 0.8)) / needles for i in range(needles)]
    context = _context(tokenizer, filler, rng, context_tokens, list(zip(depths, sentences)), question + prefix)
    return PressRow(context, question, prefix, " " + values[asked], 12)


def vt_row(tokenizer, filler: list[str], rng: random.Random, *, context_tokens: int, hops: int = HOPS) -> PressRow:
    names = _variable_names(rng, 2 * hops)
    value, decoy = rng.sample(range(10_000, 100_000), 2)
    chains = [names[:hops], names[hops:]]
    inserts = []
    for chain, start in zip(chains, (value, decoy)):
        statements = [f"VAR {chain[0]} = {start}."] + [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])]
        depths = sorted(rng.uniform(0.05, 0.95) for _ in statements)
        inserts += list(zip(depths, statements))
    question = f"\n\nQuestion: Find all variables that are assigned the value {value} in the text above."
    prefix = (
        f"\nAnswer: According to the chain of variable assignments in the text above, {hops} variables are "
        f"assigned the value {value}, they are:"
    )
    context = _context(tokenizer, filler, rng, context_tokens, inserts, question + prefix)
    return PressRow(context, question, prefix, " " + " ".join(chains[0]), 8 * hops)


def cwe_row(tokenizer, words: list[str], rng: random.Random, *, context_tokens: int, common: int = COMMON) -> PressRow:
    chosen = rng.sample(words, common)
    rest = [word for word in words if word not in chosen]
    question = f"\n\nQuestion: What are the {common} most common words in the numbered list above?"
    prefix = f"\nAnswer: The {common} words that appear most often in the list, most frequent first, are:"
    budget = context_tokens - _count(tokenizer, question + prefix)
    per_entry = 4  # " 12. word\n" is about four tokens
    entries = max(6 * common, budget // per_entry)
    weight = common * (common + 1) // 2  # the common words fill ~30% of the list, in ratio common : ... : 1
    counts = [max(3 + common - i, round(0.3 * entries * (common - i) / weight)) for i in range(common)]
    bag = [word for word, count in zip(chosen, counts) for _ in range(count)]
    while len(bag) < entries and rest:
        bag += [rest.pop(rng.randrange(len(rest)))] * rng.choice((1, 1, 2))
    rng.shuffle(bag)
    context = "Below is a numbered list of words.\n" + "".join(f"{i + 1}. {word}\n" for i, word in enumerate(bag))
    return PressRow(context, question, prefix, " " + ", ".join(chosen), 6 * common)


def _context(tokenizer, filler, rng, context_tokens, inserts, tail: str) -> str:
    stated = sum(_count(tokenizer, text) for _, text in inserts) + _count(tokenizer, tail)
    return _haystack(tokenizer, filler, rng, context_tokens - stated, inserts)


def _variable_names(rng: random.Random, count: int) -> list[str]:
    names: set[str] = set()
    while len(names) < count:
        names.add("".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)))
    return rng.sample(sorted(names), count)


def list_words(filler: list[str], *, limit: int = 400) -> list[str]:
    """Distinct lower-case words of 4-9 letters from ``filler``, in order of first use (at most ``limit``)."""
    seen: dict[str, None] = {}
    for paragraph in filler:
        for word in re.findall(r"\b[a-z]{4,9}\b", paragraph):
            seen.setdefault(word, None)
            if len(seen) >= limit:
                return list(seen)
    return list(seen)


# ---- items ------------------------------------------------------------------------------------------
def press_rows(
    task: str, tokenizer, filler: list[str], *, context_tokens: int, n: int, seed: int = 0
) -> list[PressRow]:
    """``n`` rows of ``task`` (one of :data:`RULER_TASKS`) of about ``context_tokens`` tokens each."""
    if task not in RULER_TASKS:
        raise ConfigError(f"unknown RULER-style task {task!r}; use one of {', '.join(RULER_TASKS)}")
    rng = random.Random(f"{task}-{seed}-{context_tokens}")
    if task == "cwe":
        words = list_words(filler)
        return [cwe_row(tokenizer, words, rng, context_tokens=context_tokens) for _ in range(n)]
    build = niah_multikey_row if task == "niah-multikey" else vt_row
    return [build(tokenizer, filler, rng, context_tokens=context_tokens) for _ in range(n)]


def row_item(row: PressRow, tokenizer, item_id: str) -> RecallItem:
    """The RecallItem of ``row``: prompt = context + question + answer_prefix, answer = row.answer."""
    prompt_text = row.context + row.question + row.answer_prefix
    prompt = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    answer = _answer_ids(tokenizer, prompt_text, row.answer)
    return RecallItem(
        item_id, prompt, answer, row.answer.strip(), {"context_tokens": len(prompt), "row": row.as_dict()}
    )


def ruler_items(
    task: str, tokenizer, filler: list[str], *, context_tokens: int, n: int, seed: int = 0
) -> list[RecallItem]:
    rows = press_rows(task, tokenizer, filler, context_tokens=context_tokens, n=n, seed=seed)
    return [row_item(row, tokenizer, f"{task}-{context_tokens}-{i}") for i, row in enumerate(rows)]
