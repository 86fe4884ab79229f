"""Long-context tasks where one fact decides the answer, scored exactly, with a no-information control.

Multiple-choice retention (kvhub.eval.taskeval) hides what a handoff loses: its items barely depend on a
single stated fact.  Here every item is a long context that states something once and a prompt that
ends where the answer starts; the answer is scored by teacher forcing: correct iff every answer token
is the model's greedy choice (what greedy decoding would write), plus the answer's log-likelihood.

Tasks (``context_tokens`` sets the length of the context, approximately, at paragraph/line bounds):

- ``facts``:     passkey retrieval.  1-3 sentences "The access code for the {colour} {thing} vault is
                 {5 digits}." at depths swept over the context (the asked one at depth d, the others
                 as distractors) inside filler prose; the prompt asks for one vault's code.
- ``multiturn``: a chat (the tokenizer's chat template): the user states a number in the first turn,
                 several turns of other talk follow, the last turn asks for the number.
- ``code``:      next-line completion after a long Python file prefix, from installed packages that no
                 calibration set uses (click, rich, sqlalchemy; the ``code`` set is the stdlib).

Conditions per item (one ItemScore per recompute variant; own/source/floor shared):

- ``own``:     the target from its own cache of the prompt;
- ``mapped``:  the handoff (map + the variant's exact recompute, :mod:`kvhub.serving.recompute`);
- ``drop``:    the no-fit alternative: the target prefills only the positions the handoff recomputed,
               at their true positions, and nothing else (:mod:`kvhub.serving.drop`; same selection,
               same target compute as the recompute pass);
- ``control``: the same recompute over the no-information control map (:mod:`kvhub.core.control`);
- ``source``:  the source model alone;
- ``floor``:   the target given only the last ``FLOOR_TOKENS`` prompt tokens (the question).
"""

from __future__ import annotations

import importlib.util
import math
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from kvhub.core.capture import cache_kwargs, run_model
from kvhub.errors import ConfigError
from kvhub.eval.bootstrap import with_intervals

LONG_CONDITIONS = ("own", "mapped", "drop", "control", "source", "floor")
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
FLOOR_TOKENS = 32
CODE_PACKAGES = ("click", "rich", "sqlalchemy")

_COLOURS = ("red", "blue", "green", "amber", "violet", "silver", "golden", "black", "white", "orange", "grey", "teal")
_THINGS = (
    "harbour",
    "granite",
    "orchard",
    "lantern",
    "compass",
    "falcon",
    "meadow",
    "quarry",
    "beacon",
    "willow",
    "cobalt",
    "summit",
)
_CHAT_THINGS = ("locker number", "badge number", "flight booking code", "parcel tracking number", "room number")


@dataclass
class RecallItem:
    """A prompt (token ids, ending where the answer starts) and the answer's token ids."""

    id: str
    prompt_ids: list[int]
    answer_ids: list[int]
    answer: str
    meta: dict = field(default_factory=dict)


# ---- building items ----------------------------------------------------------------------------------
def fact_items(
    tokenizer,
    filler: list[str],
    *,
    context_tokens: int,
    n: int,
    seed: int = 0,
    facts_per_context: tuple[int, ...] = (1, 2, 3),
    depths: tuple[float, ...] = DEPTHS,
) -> list[RecallItem]:
    """Passkey items: item i has ``facts_per_context[i % len]`` facts, the asked one at ``depths[i % len]``
    (3 and 5 values: every 15 items hold each pair once, and any first n are balanced in both)."""
    rng = random.Random(f"facts-{seed}-{context_tokens}")
    items = []
    for i in range(n):
        count, depth = facts_per_context[i % len(facts_per_context)], depths[i % len(depths)]  # coprime: all pairs
        vaults = rng.sample([(c, t) for c in _COLOURS for t in _THINGS], count)
        codes = [str(rng.randrange(10_000, 100_000)) for _ in vaults]
        sentences = [f"The access code for the {c} {t} vault is {code}." for (c, t), code in zip(vaults, codes)]
        where = [depth] + [rng.uniform(0.05, 0.95) for _ in vaults[1:]]
        colour, thing = vaults[0]
        question = (
            f"\n\nQuestion: What is the access code for the {colour} {thing} vault?\n"
            f"Answer: The access code for the {colour} {thing} vault is"
        )
        stated = sum(_count(tokenizer, text) for text in sentences + [question])
        body = _haystack(tokenizer, filler, rng, context_tokens - stated, list(zip(where, sentences)))
        prompt = tokenizer(body + question, add_special_tokens=False)["input_ids"]
        answer = _answer_ids(tokenizer, body + question, " " + codes[0])
        items.append(
            RecallItem(
                f"facts-{context_tokens}-{i}",
                prompt,
                answer,
                codes[0],
                {"context_tokens": len(prompt), "depth": depth, "facts": count},
            )
        )
    return items


def multiturn_items(tokenizer, filler: list[str], *, context_tokens: int, n: int, seed: int = 0) -> list[RecallItem]:
    """Chat items: a number stated in turn 1, ~``context_tokens`` of other turns, then the question."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("the multiturn task needs a tokenizer with a chat template (an instruct model)")
    rng = random.Random(f"multiturn-{seed}-{context_tokens}")
    items = []
    for i in range(n):
        thing, value = _CHAT_THINGS[i % len(_CHAT_THINGS)], str(rng.randrange(1000, 10_000))
        messages = [
            {"role": "user", "content": f"Please remember this: my {thing} is {value}."},
            {"role": "assistant", "content": "Noted. What else can I help you with?"},
        ]
        used = 0
        while used < context_tokens:
            paragraph = rng.choice(filler)
            messages += [
                {"role": "user", "content": f"Here is a passage:\n{paragraph}\nWhat happens next?"},
                {"role": "assistant", "content": _first_sentence(paragraph)},
            ]
            used += _count(tokenizer, paragraph) + 30
        messages.append({"role": "user", "content": f"What is my {thing}? Reply with the number only."})
        prompt_text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        answer = _answer_ids(tokenizer, prompt_text, value)
        items.append(
            RecallItem(
                f"multiturn-{context_tokens}-{i}",
                prompt,
                answer,
                value,
                {"context_tokens": len(prompt), "turns": len(messages) // 2},
            )
        )
    return items


def code_items(
    tokenizer, *, context_tokens: int, n: int, seed: int = 0, packages: tuple[str, ...] = CODE_PACKAGES
) -> list[RecallItem]:
    """Next-line items: ~``context_tokens`` of a Python file, then its next non-trivial line."""
    files = _code_files(packages)
    rng = random.Random(f"code-{seed}-{context_tokens}")
    rng.shuffle(files)
    items = []
    for path in files:
        if len(items) == n:
            break
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        prefix, cut = "", None
        for index, line in enumerate(lines):
            prefix += line
            if len(prefix) > context_tokens and _count(tokenizer, prefix) >= context_tokens:
                cut = index + 1
                break
        if cut is None:
            continue
        follow = next((j for j in range(cut, len(lines)) if _worth_completing(lines[j])), None)
        if follow is None:
            continue
        prompt, answer = _split_at_line(tokenizer, "".join(lines[:follow]), lines[follow].rstrip("\n"))
        if len(prompt) > context_tokens * 5 // 4:  # the next code line lies far beyond the asked length
            continue
        text = tokenizer.decode(answer)
        relative = path.name if not path.parent.name else f"{path.parent.name}/{path.name}"
        items.append(
            RecallItem(
                f"code-{context_tokens}-{relative}:{follow + 1}",
                prompt,
                answer,
                text,
                {"context_tokens": len(prompt), "file": relative},
            )
        )
    if len(items) < n:
        raise ConfigError(
            f"found only {len(items)} Python files of {', '.join(packages)} with {context_tokens}+ "
            "tokens; ask for fewer items or shorter contexts"
        )
    return items


def _haystack(tokenizer, filler, rng, context_tokens, inserts: list[tuple[float, str]]) -> str:
    """Filler paragraphs of about ``context_tokens`` tokens with each (depth, sentence) inserted between them."""
    paragraphs, used = [], 0
    order = list(range(len(filler)))
    rng.shuffle(order)
    for index in order * (1 + context_tokens // 20):
        if used >= context_tokens:
            break
        paragraphs.append(filler[index])
        used += _count(tokenizer, filler[index]) + 1
    for depth, sentence in sorted(inserts, reverse=True):
        paragraphs.insert(round(depth * len(paragraphs)), sentence)
    return "\n".join(paragraphs)


def _split_at_line(tokenizer, prefix: str, line: str) -> tuple[list[int], list[int]]:
    """Token ids of ``prefix + line`` split where the line's code starts: the answer is every token that
    ends past the indentation (so a token merging the indent with the code belongs to the answer)."""
    encoded = tokenizer(prefix + line, add_special_tokens=False, return_offsets_mapping=True)
    start = len(prefix) + len(line) - len(line.lstrip())
    cut = next(i for i, (_, end) in enumerate(encoded["offset_mapping"]) if end > start)
    return encoded["input_ids"][:cut], encoded["input_ids"][cut:]


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _answer_ids(tokenizer, prompt_text: str, answer: str) -> list[int]:
    """Tokens the answer adds after the prompt (tokenised together, so merges at the seam are kept)."""
    prompt = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    whole = tokenizer(prompt_text + answer, add_special_tokens=False)["input_ids"]
    if whole[: len(prompt)] != prompt:
        raise ConfigError(f"the answer {answer!r} merges with the end of its prompt; the item cannot be scored")
    return whole[len(prompt) :]


def _first_sentence(text: str) -> str:
    head = text.split(". ")[0].strip()
    return head if head.endswith(".") else head + "."


def _worth_completing(line: str) -> bool:
    """A line of code (not a comment or docstring prose) long enough to be more than a guess."""
    stripped = line.strip()
    code_like = any(mark in stripped for mark in ("(", " = ", "return ", "import ")) and not stripped.endswith(".")
    return len(stripped) >= 12 and code_like and not stripped.startswith(("#", '"""', "'''", ">>>", "..", "`"))


def _code_files(packages: tuple[str, ...]) -> list[Path]:
    files = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(f"the code task reads the installed package {name!r}; pip install it")
        for root in spec.submodule_search_locations:
            files += sorted(Path(root).rglob("*.py"))
    return sorted(files)


def check_positions(items, models, *, extra: int, context_tokens: int) -> None:
    """ConfigError when an item's prompt plus ``extra`` tokens (its answer) runs past a model's
    ``max_position_embeddings``: built prompts come out longer than --context-tokens (whole paragraphs,
    the question, a chat template), so the requested length alone does not tell."""
    limits = [
        (m.config.max_position_embeddings, m.config.model_type)
        for m in models
        if isinstance(getattr(m.config, "max_position_embeddings", None), int)
    ]
    if not limits or not items:
        return
    limit, kind = min(limits)
    longest = max(len(item.prompt_ids) for item in items) + extra
    if longest > limit:
        raise ConfigError(
            f"--context-tokens {context_tokens} builds prompts of up to {longest} tokens with their answers, past "
            f"the {kind} model's {limit} positions (max_position_embeddings); use --context-tokens "
            f"{max(64, context_tokens - (longest - limit) - 16)} or less"
        )


def filler_paragraphs(*, limit: int = 2000, seed: int = 0) -> list[str]:
    """Filler prose outside every calibration set: HellaSwag contexts with their correct endings."""
    from kvhub.eval.tasks import load_task

    return [item.context + item.continuations[item.label] for item in load_task("hellaswag", limit=limit, seed=seed)]


# ---- scoring -------------------------------------------------------------------------------------
@dataclass
class RecallScore:
    """Per item and variant: exact[c] 1/0 (greedy would write the answer), token_acc[c], logp[c] per condition;
    predicted[c]: the argmax tokens at the answer's positions (teacher-forced), decoded; gold: the answer."""

    id: str
    exact: dict
    token_acc: dict
    logp: dict
    recomputed: int = 0  # context tokens the variant recomputed exactly
    meta: dict = field(default_factory=dict)
    predicted: dict = field(default_factory=dict)
    gold: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_record(cls, record: dict, *, conditions: tuple[str, ...] = ()) -> "RecallScore":
        """Read a cached record back; one written before predictions were kept, or without one of
        ``conditions`` (written before that condition existed), is refused (ValueError), so the per-item
        cache scores that item again."""
        if not record.get("predicted"):
            raise ValueError("record without predictions")
        if any(c not in record.get("exact", {}) for c in conditions):
            raise ValueError("record without a condition scored now")
        return cls(**record)


@torch.no_grad()
def answer_score(
    model, cache, tail_ids: list[int], answers: int, *, start: int | None = None
) -> tuple[int, float, float, list[int]]:
    """(exact, token accuracy, log-likelihood, argmax ids) of the last ``answers`` of ``tail_ids`` continuing
    ``cache`` (which holds everything before tail_ids[0]); the cache grows.  ``start``: the position of
    tail_ids[0] when the cache holds fewer entries than positions (a drop cache); default its length."""
    device = next(model.parameters()).device
    ids = torch.tensor([tail_ids], device=device)
    past = cache.get_seq_length() if start is None else start
    positions = torch.arange(past, past + ids.shape[1], device=device).unsqueeze(0)
    logits = (
        model(input_ids=ids, position_ids=positions, use_cache=True, **cache_kwargs(model, cache)).logits[0].float()
    )
    predicted = logits[-answers - 1 : -1]  # (A, V): the positions that predict the answer tokens
    target = ids[0, -answers:]
    hits = predicted.argmax(-1) == target
    logp = F.log_softmax(predicted, -1).gather(1, target[:, None]).sum()
    return int(hits.all()), float(hits.float().mean()), float(logp), predicted.argmax(-1).tolist()


@torch.no_grad()
def score_recall_item(item: RecallItem, *, mapper, control, source, target, tokenizer, variants) -> list[RecallScore]:
    """Score ``item`` under every condition; one RecallScore per :class:`~kvhub.serving.recompute.Recompute` variant."""
    from kvhub.serving.drop import drop_cache
    from kvhub.serving.handoff import prepare_cache_counted

    prompt, answer = item.prompt_ids, item.answer_ids
    device = next(target.parameters()).device
    tail = [prompt[-1]] + answer
    context = torch.tensor([prompt[:-1]], device=device)
    shared = {"own": answer_score(target, run_model(target, context), tail, len(answer))}
    source_cache = run_model(source, context)
    floor = torch.tensor([prompt[-FLOOR_TOKENS:-1]], device=device)
    shared["floor"] = answer_score(target, run_model(target, floor), tail, len(answer))
    scores, recomputed = [], []
    ids = torch.tensor([prompt], device=device)
    for spec in variants:
        spec = spec.capped(len(prompt) - 1)
        result = dict(shared)
        for name, which in (("mapped", mapper), ("control", control)):
            cache, positions = prepare_cache_counted(
                which, source, target, ids, recompute=spec, tokenizer=tokenizer, source_cache=source_cache
            )
            result[name] = answer_score(target, cache, tail, len(answer))
            if name == "mapped":  # the count of the mapped handoff (the control selects from another cache)
                recomputed.append(int(positions.numel()))
                kept = drop_cache(target, context, positions)  # the same positions, nothing mapped
                result["drop"] = answer_score(target, kept, tail, len(answer), start=context.shape[1])
        scores.append(result)
    result_source = answer_score(source, source_cache, tail, len(answer))  # last: it grows source_cache
    for result in scores:
        result["source"] = result_source
    return [recall_score(item, result, count, tokenizer) for result, count in zip(scores, recomputed)]


def recall_score(item: RecallItem, result: dict, recomputed: int, tokenizer) -> RecallScore:
    """A RecallScore from ``result``: condition -> :func:`answer_score`'s tuple (the conditions present, in
    :data:`LONG_CONDITIONS` order)."""
    result = {c: result[c] for c in LONG_CONDITIONS if c in result}
    return RecallScore(
        id=item.id,
        exact={c: r[0] for c, r in result.items()},
        token_acc={c: r[1] for c, r in result.items()},
        logp={c: r[2] for c, r in result.items()},
        recomputed=recomputed,
        meta=item.meta,
        predicted={c: tokenizer.decode(r[3]) for c, r in result.items()},
        gold=item.answer,
    )


RECALL_PAIRS = (("mapped", "control"), ("mapped", "drop"))


def summarize_recall(
    scores: list[RecallScore],
    *,
    seed: int = 0,
    resamples: int = 1000,
    pairs: tuple[tuple[str, str], ...] = RECALL_PAIRS,
) -> dict:
    """Exact-match accuracy per condition with bootstrap 95% intervals; retention = mapped / own, and the paired
    differences of ``pairs`` (``map_minus_control``: the map's own contribution; ``map_minus_drop``: what the
    map adds over keeping the recomputed tokens alone), each with its interval; mean token accuracy.  Conditions absent from the scores
    (a record written before ``drop`` existed, a served run) are left out."""
    if not scores:
        return {"n": 0}
    n = len(scores)
    conditions = [c for c in scores[0].exact if all(c in s.exact for s in scores)]
    columns = {c: [s.exact[c] for s in scores] for c in conditions}

    def stats(index) -> dict:
        acc = {c: sum(columns[c][i] for i in index) / len(index) for c in conditions}
        out = {f"acc_{c}": acc[c] for c in conditions}
        out["retention"] = acc["mapped"] / acc["own"] if acc["own"] else math.nan
        for first, second in pairs:
            if first in acc and second in acc:
                out[f"{'map' if first == 'mapped' else first}_minus_{second}"] = acc[first] - acc[second]
        return out

    out = {"n": n, **with_intervals(stats, n, seed=seed, resamples=resamples)}
    for c in conditions:
        out[f"token_acc_{c}"] = sum(s.token_acc[c] for s in scores) / n
    out["context_tokens"] = sum(s.meta.get("context_tokens", 0) for s in scores) / n
    out["recomputed_fraction"] = sum(s.recomputed / max(1, s.meta.get("context_tokens", 1) - 1) for s in scores) / n
    return out
