"""RULER-style long-context tasks built offline, in kvpress's row format, scored as :mod:`kvhub.eval.longctx` scores.

Single-needle retrieval is easy for anything that keeps the tokens the question points at (a query-aware
selection finds them).  These tasks need more of the context than one span (RULER, Hsieh et al. 2024):

- ``niah-multikey``: :data:`NEEDLES` needles "One of the special magic numbers for {key} is: {7 digits}." at
  spread depths in filler prose; the question asks for one key's number, the others are decoys of the
  same shape;
- ``vt``: variable tracking.  A chain ``VAR A = 12345``, ``VAR B = VAR A``, ... of :data:`HOPS` assignments
  from the first third of the context to the last, and a decoy chain of :data:`DECOY_HOPS` with another value;
  the answer names every variable of the asked value's chain, in order, as the model lists them
  ("VAR A and VAR B");
- ``cwe``: common-words extraction, aggregation.  A numbered list of words in which :data:`COMMON` words
  recur (each a distinct number of times, together :data:`COMMON_SHARE` of the list) among words that occur
  once or twice; the answer lists the common words from the most frequent down ('"pulls" and "container".', with
  the period: the model writes '".' as one token).

The parameters are the largest that the 1.5B target's own prefill answers at 1k tokens (issue 47: own >= 0.8,
so the tasks can separate the handoff from drop); RULER's defaults (4 hops, 10 common words) score 0 there.

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
# Measured on Qwen2.5-Coder-1.5B-Instruct's own prefill at 1k tokens, fp32 (docs/benchmarks.md, section 7):
#   nice -n 10 python benchmarks/own_accuracy.py --tasks vt,cwe --context-tokens 1024 --n 6 --out own.json  # vt; cwe: --n 5
# Neither reaches issue 47's 0.8 yet: vt 2/6 (the first variable always right, the second often the decoy's),
# cwe 2/5 (two of the misses name the right words in the wrong order).  RULER's 4 hops and 3 common words at 30% score 0.
HOPS = 2
DECOY_HOPS = 1
COMMON = 2
COMMON_SHARE = 0.5  # the common words' share of the list

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
    names = _variable_names(rng, hops + DECOY_HOPS)
    value, decoy = rng.sample(range(10_000, 100_000), 2)
    inserts = []
    for chain, start in ((names[:hops], value), (names[hops:], decoy)):
        statements = [f"VAR {chain[0]} = {start}."] + [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])]
        spread = start == value  # the asked chain runs from the first third to the last; the decoy anywhere
        depths = _spread_depths(rng, len(statements)) if spread else sorted(rng.uniform(0.05, 0.95) for _ in chain)
        inserts += list(zip(depths, statements))
    question = (
        f"\n\nQuestion: Find all variables that are assigned the value {value} in the text above, directly or "
        "through another variable."
    )
    prefix = (
        f"\nAnswer: According to the chain of variable assignments in the text above, {hops} variables are "
        f"assigned the value {value}, they are:"
    )
    context = _context(tokenizer, filler, rng, context_tokens, inserts, question + prefix)
    return PressRow(context, question, prefix, " " + _listed([f"VAR {name}" for name in names[:hops]]), 8 * hops)


def cwe_row(tokenizer, words: list[str], rng: random.Random, *, context_tokens: int, common: int = COMMON) -> PressRow:
    chosen = rng.sample(words, common)
    rest = [word for word in words if word not in chosen]
    question = f"\n\nQuestion: What are the {common} most common words in the numbered list above?"
    prefix = f"\nAnswer: The {common} words that appear most often in the list, most frequent first, are:"
    budget = context_tokens - _count(tokenizer, question + prefix)
    sample = words[:20]
    per_entry = _count(tokenizer, "".join(f"{100 + i}. {word}\n" for i, word in enumerate(sample))) / len(sample)
    entries = max(6 * common, int(budget / per_entry))
    weight = common * (common + 1) // 2  # the common words fill COMMON_SHARE of the list, in ratio common : ... : 1
    counts = [max(3 + common - i, round(COMMON_SHARE * entries * (common - i) / weight)) for i in range(common)]
    bag = [word for word, count in zip(chosen, counts) for _ in range(count)]
    while len(bag) < entries and rest:
        bag += [rest.pop(rng.randrange(len(rest)))] * rng.choice((1, 1, 2))
    rng.shuffle(bag)
    context = "Below is a numbered list of words.\n" + "".join(f"{i + 1}. {word}\n" for i, word in enumerate(bag))
    return PressRow(context, question, prefix, " " + _listed([f'"{word}"' for word in chosen]) + ".", 6 * common)


def _listed(parts: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``: how the model lists what it was asked for."""
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _context(tokenizer, filler, rng, context_tokens, inserts, tail: str) -> str:
    stated = sum(_count(tokenizer, text) for _, text in inserts) + _count(tokenizer, tail)
    return _haystack(tokenizer, filler, rng, context_tokens - stated, inserts)


def _spread_depths(rng: random.Random, count: int) -> list[float]:
    """``count`` increasing depths in (0.05, 0.95), each in its own of max(count, 3) equal stretches, the first and
    the last stretch always among them: the asked chain starts in the first third and ends in the last."""
    stretches = max(count, 3)
    chosen = [round(i * (stretches - 1) / (count - 1)) for i in range(count)] if count > 1 else [0]
    return [0.05 + 0.9 * (s + rng.uniform(0.3, 0.7)) / stretches for s in chosen]


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
