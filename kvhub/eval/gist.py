"""The gist: does the large model answer about the WHOLE context after a handoff, or almost as if it had none?

Facts (kvhub.eval.longctx) test one stated detail.  Here each item is a long context and a request about
all of it (summarize a chat or a document, continue a code file); the target's own greedy answer A
(``answer_tokens`` tokens, from its own prefill) is scored teacher-forced, as mean negative
log-likelihood per token, under each cache:

- ``own``:     the target's own cache of the prompt (the reference, lowest NLL by construction);
- ``mapped``:  the handoff (map + the variant's exact recompute, :mod:`kvhub.serving.recompute`);
- ``drop``:    the no-fit alternative: the target prefills only the positions the handoff recomputed, at
               their true positions, and nothing else (:mod:`kvhub.serving.drop`);
- ``control``: the same recompute over the no-information control map (:mod:`kvhub.core.control`);
- ``floor``:   the context dropped: the target given only the last ``FLOOR_TOKENS`` prompt tokens
               (the request itself), the no-context floor;
- ``wrong``, ``zero``: the controls of :mod:`kvhub.eval.gist_controls` (the same path over another item's
               context, and over an all-zero mapped cache), where the backend scores them.

    gap closed = (NLL_floor - NLL_variant) / (NLL_floor - NLL_own)

is 1 for a cache as informative as the target's own and 0 for one that tells the target no more than
the request alone (negative: worse than no context).  The aggregate is the ratio of the mean NLLs over
items, with a bootstrap 95% interval over items.  A result counts only where it beats every control
(``gap_closed_map_minus_controls`` > 0: mapped minus the best of control, wrong and zero).
"""

from __future__ import annotations

import copy
import functools
import math
import random
from dataclasses import asdict, dataclass, field

import torch

from kvhub.core.capture import run_model
from kvhub.errors import ConfigError
from kvhub.eval.bootstrap import with_intervals
from kvhub.eval.catalog import GIST_KINDS
from kvhub.eval.gist_controls import GIST_CONTROLS, with_wrong_documents

GIST_CONDITIONS = ("own", "mapped", "drop", "control", "floor")
FLOOR_TOKENS = 32
ANSWER_TOKENS = 48


@dataclass
class GistItem:
    """A prompt (token ids: a context and a request about all of it) and its kind; ``wrong_ids``: the same
    request over another item's context, the wrong-document control (None: not scored); ``key`` / ``key_ids``:
    the keyed answer where the item has one, the tokens a correct reply starts with right after the prompt."""

    id: str
    prompt_ids: list[int]
    meta: dict = field(default_factory=dict)
    wrong_ids: list[int] | None = None
    key: str | None = None
    key_ids: list[int] | None = None


@dataclass
class GistScore:
    """Per item and recompute variant: nll[c] mean NLL per answer token under each condition, the answer; where
    scored by generation, rouge[c] the ROUGE-L F1 of the target's greedy answer under c against it."""

    id: str
    nll: dict
    answer: list[int]
    meta: dict = field(default_factory=dict)
    keyed: dict = field(default_factory=dict)  # condition -> 1 / 0: greedy would write the key (keyed items)
    rouge: dict = field(default_factory=dict)  # condition -> ROUGE-L F1 of what greedy writes against ``answer``
    written: dict = field(default_factory=dict)  # condition -> the greedy ids themselves
    judged: dict = field(default_factory=dict)  # condition -> the judge's P(says what ``answer`` says)

    def as_dict(self) -> dict:
        return asdict(self)


# ---- items -----------------------------------------------------------------------------------------
def gist_items(
    kind: str, tokenizer, *, context_tokens: int, n: int, seed: int = 0, filler: list[str] | None = None
) -> list[GistItem]:
    """``n`` items of ``kind``: a chat of ~``context_tokens`` tokens then "summarize what we discussed"; a
    document then "summarize the text above"; a code file prefix to be continued."""
    if kind not in GIST_KINDS:
        raise ConfigError(f"unknown gist kind {kind!r}; use one of {', '.join(GIST_KINDS)}")
    if context_tokens < 64:
        raise ConfigError(f"--context-tokens must be at least 64, got {context_tokens}")
    from kvhub.eval import longctx

    if kind == "code":
        return [
            GistItem(f"gist-code-{context_tokens}-{i}", item.prompt_ids, {**item.meta, "kind": kind})
            for i, item in enumerate(longctx.code_items(tokenizer, context_tokens=context_tokens, n=n, seed=seed))
        ]
    filler = filler if filler is not None else longctx.filler_paragraphs(seed=seed)
    rng = random.Random(f"gist-{kind}-{seed}-{context_tokens}")
    build = _chat if kind == "chat" else _document
    items = []
    for i in range(n):
        prompt = build(tokenizer, filler, rng, context_tokens)
        items.append(
            GistItem(f"gist-{kind}-{context_tokens}-{i}", prompt, {"kind": kind, "context_tokens": len(prompt)})
        )
    return items


def _chat(tokenizer, filler, rng, context_tokens) -> list[int]:
    messages, used = [], 0
    while used < context_tokens:
        paragraph = rng.choice(filler)
        messages += [
            {"role": "user", "content": f"Here is a passage:\n{paragraph}\nWhat do you make of it?"},
            {"role": "assistant", "content": paragraph.split(". ")[0].strip().rstrip(".") + "."},
        ]
        used += len(tokenizer(paragraph, add_special_tokens=False)["input_ids"]) + 40  # + the reply and template
    messages.append({"role": "user", "content": "Summarize what we discussed in this conversation, briefly."})
    return _templated(tokenizer, messages)


def _document(tokenizer, filler, rng, context_tokens) -> list[int]:
    paragraphs, used = [], 0
    while used < context_tokens:
        paragraph = rng.choice(filler)
        paragraphs.append(paragraph)
        used += len(tokenizer(paragraph, add_special_tokens=False)["input_ids"]) + 1
    request = "\n\n".join(paragraphs) + "\n\nSummarize the text above in a few sentences."
    return _templated(tokenizer, [{"role": "user", "content": request}])


def _templated(tokenizer, messages) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "the gist's chat and document items need a tokenizer with a chat template (an instruct model)"
        )
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ---- scoring ---------------------------------------------------------------------------------------------
@torch.no_grad()
def own_answer(target, prompt_ids: list[int], *, answer_tokens: int = ANSWER_TOKENS) -> list[int]:
    """The target's greedy answer from its own prefill of the prompt (``answer_tokens`` tokens, eos kept)."""
    device = next(target.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)
    out = target.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=answer_tokens,
        do_sample=False,
        min_new_tokens=answer_tokens,
        pad_token_id=target.config.eos_token_id or 0,
    )
    return out[0, ids.shape[1] :].tolist()


def answer_nll(model, cache, tail_ids: list[int], answers: int, *, start: int | None = None) -> float:
    """Mean NLL per token of the last ``answers`` of ``tail_ids`` continuing ``cache`` (which holds everything
    before tail_ids[0]; it grows): longctx's teacher-forced score, its log-likelihood per token negated.
    ``start``: the position of tail_ids[0] when the cache holds fewer entries (a drop cache)."""
    from kvhub.eval.longctx import answer_score

    return -answer_score(model, cache, tail_ids, answers, start=start)[2] / answers


@torch.no_grad()
def score_gist_item(
    item: GistItem,
    *,
    mapper,
    control,
    source,
    target,
    tokenizer,
    variants,
    answer_tokens: int = ANSWER_TOKENS,
    zero=None,
    raw=None,
    generate: bool = True,
    judged: bool = True,
) -> list[GistScore]:
    """One GistScore per :class:`~kvhub.serving.spec.Recompute` variant (own and floor shared); ``wrong`` where the
    item has ``wrong_ids``, ``zero`` where ``zero`` (:func:`kvhub.eval.gist_controls.zero_mapper`) and ``raw``
    where ``raw`` (:class:`kvhub.eval.gist_controls.RawSourceMap`) is given, each through the variant's recompute
    like ``mapped``.  A keyed item (``key_ids``) also gets ``keyed[c]`` per condition: 1 when every key token is
    the greedy choice after the prompt under that condition's cache, else 0.  With ``generate``, ``rouge[c]``: the
    target's greedy answer under each condition's cache (:func:`kvhub.eval.generation.greedy_rows`, all the
    variant's caches in one batch) against its own answer, and with ``judged`` too, ``judged[c]``: the target as
    a judge of whether that answer says what its own does (:func:`kvhub.eval.judge.judge`), and ``written[c]``:
    the answer itself."""
    from kvhub.eval.generation import Row, greedy_rows, rouge_l
    from kvhub.eval.judge import judge, judge_key
    from kvhub.serving.drop import drop_cache
    from kvhub.serving.handoff import prepare_cache_counted

    prompt = item.prompt_ids
    answer = own_answer(target, prompt, answer_tokens=answer_tokens)
    device = next(target.parameters()).device
    context = torch.tensor([prompt[:-1]], device=device)
    score = functools.partial(_score_cache, target, prompt, answer, item.key_ids)
    shared = {  # scored with the first variant
        "own": Row(run_model(target, context)),
        "floor": Row(run_model(target, torch.tensor([prompt[-FLOOR_TOKENS:-1]], device=device))),
    }
    source_cache = run_model(source, context)
    ids = torch.tensor([prompt], device=device)
    paths = [("mapped", mapper, ids, source_cache), ("control", control, ids, source_cache)]
    paths += [(name, which, ids, source_cache) for name, which in (("zero", zero), ("raw", raw)) if which is not None]
    if item.wrong_ids is not None:  # the same request (and last token) over another item's context
        wrong = torch.tensor([item.wrong_ids], device=device)
        paths.append(("wrong", mapper, wrong, run_model(source, wrong[:, :-1])))
    scores, first = [], {}
    for spec in variants:
        spec = spec.capped(len(prompt) - 1)
        rows = dict(shared) if not first else {}
        for name, which, prompt_ids, cached in paths:
            cache, positions = prepare_cache_counted(
                which, source, target, prompt_ids, recompute=spec, tokenizer=tokenizer, source_cache=cached
            )
            rows[name] = Row(cache)
            if name == "mapped":  # the same positions, nothing mapped
                rows["drop"] = Row(drop_cache(target, context, positions), start=context.shape[1])
        rouge, written, judgments = {}, {}, {}
        if generate:  # before the teacher-forced scores, which grow the caches
            written = dict(zip(rows, greedy_rows(target, list(rows.values()), prompt[-1], len(answer))))
            rouge = {name: rouge_l(tokens, answer) for name, tokens in written.items()}
            if judged:
                judgments = dict(zip(written, judge(target, tokenizer, answer, list(written.values()))))
        nll, keyed = {}, {}
        for name, row in rows.items():
            nll[name], keyed[name] = score(row.cache, start=row.start)
        if not first:
            first = {c: (nll[c], keyed[c], rouge.get(c), written.get(c), judgments.get(c)) for c in shared}
        for c, (value, key, generated, tokens, judgment) in first.items():
            nll[c], keyed[c] = value, key
            if generated is not None:
                rouge[c], written[c] = generated, tokens
            if judgment is not None:
                judgments[c] = judgment
        keyed = {c: v for c, v in keyed.items() if v is not None}
        meta = {**item.meta, "variant": spec.name(), **({"judge": judge_key()} if judgments else {})}
        scores.append(GistScore(item.id, nll, answer, meta, keyed, rouge, written, judgments))
    return scores


def _score_cache(target, prompt, answer, key_ids, cache, *, start=None) -> tuple[float, int | None]:
    """(mean NLL of the own ``answer`` after the prompt, 1 / 0 for the key where there is one, else None) under
    ``cache`` (the context before the prompt's last token); the key is scored first, on a copy."""
    from kvhub.eval.longctx import answer_score

    keyed = None
    if key_ids:
        keyed = answer_score(target, copy.deepcopy(cache), [prompt[-1]] + key_ids, len(key_ids), start=start)[0]
    return answer_nll(target, cache, [prompt[-1]] + answer, len(answer), start=start), keyed


def gap_closed(nll: dict, condition: str) -> float:
    """(floor - condition) / (floor - own) from per-condition NLLs; nan when own is no better than the floor."""
    span = nll["floor"] - nll["own"]
    return (nll["floor"] - nll[condition]) / span if span > 0 else math.nan


def gen_gap_closed(rouge: dict, condition: str) -> float:
    """(condition - floor) / (own - floor) from per-condition scores of what greedy wrote, higher is better
    (ROUGE-L, the judge's); nan when own's generation scores no better than the floor's."""
    span = rouge["own"] - rouge["floor"]
    return (rouge[condition] - rouge["floor"]) / span if span > 0 else math.nan


def _closing(values: dict, closed, prefix: str, controls: list) -> dict:
    """``{prefix}_<c>``: the gap ``closed(values, c)`` by mapped, drop and each control present in ``values``;
    ``{prefix}_map_minus_<c>``: mapped minus each of them; ``{prefix}_map_minus_controls``: mapped minus the best
    control, where there are several."""
    out = {}
    for condition in ("mapped", "drop", "control", *GIST_CONTROLS):
        if condition in values:
            out[f"{prefix}_{condition}"] = closed(values, condition)
    for other in ("control", "drop", *GIST_CONTROLS):
        if other in values:
            out[f"{prefix}_map_minus_{other}"] = out[f"{prefix}_mapped"] - out[f"{prefix}_{other}"]
    if len(controls) > 1:
        out[f"{prefix}_map_minus_controls"] = min(out[f"{prefix}_map_minus_{c}"] for c in controls)
    return out


def summarize_gist(scores: list[GistScore], *, seed: int = 0, resamples: int = 1000) -> dict:
    """Mean NLL per condition, gap closed by ``mapped``, ``drop``, ``control``, ``wrong`` and ``zero`` (ratio of
    the means, where scored) with bootstrap 95% intervals over items, the paired differences mapped - each of
    them, and ``gap_closed_map_minus_controls``: mapped - the best of the controls (control, wrong, zero).  Where
    every item was scored by generation, the same by ROUGE-L: ``rouge_<c>`` and ``gen_gap_closed_*``; where every
    item was judged, by the judge: ``judged_<c>`` and ``judge_gap_closed_*``."""
    if not scores:
        return {"n": 0}
    conditions = [c for c in GIST_CONDITIONS + GIST_CONTROLS if all(c in s.nll for s in scores)]  # served: no drop
    controls = [c for c in ("control", *GIST_CONTROLS) if c in conditions]
    generated, judged = (_scored_on_every_item(scores, conditions, name) for name in ("rouge", "judged"))

    def stats(index) -> dict:
        mean = {c: sum(scores[i].nll[c] for i in index) / len(index) for c in conditions}
        out = {f"nll_{c}": mean[c] for c in conditions}
        out.update(_closing(mean, gap_closed, "gap_closed", controls))
        for field_name, prefix, scored in (
            ("rouge", "gen_gap_closed", generated),
            ("judged", "judge_gap_closed", judged),
        ):
            mean = {c: sum(getattr(scores[i], field_name)[c] for i in index) / len(index) for c in scored}
            out.update({f"{field_name}_{c}": mean[c] for c in scored})
            if scored:
                out.update(_closing(mean, gen_gap_closed, prefix, [c for c in controls if c in scored]))
        return out

    out = {"n": len(scores), **with_intervals(stats, len(scores), seed=seed, resamples=resamples)}
    out["context_tokens"] = sum(s.meta.get("context_tokens", 0) for s in scores) / len(scores)
    out.update(summarize_keyed(scores, seed=seed, resamples=resamples))
    return out


def _scored_on_every_item(scores: list[GistScore], conditions: list, field_name: str) -> list:
    """The conditions every score has in ``field_name`` (rouge, judged); none unless own, floor and mapped are."""
    scored = [c for c in conditions if all(c in getattr(s, field_name) for s in scores)]
    return scored if {"own", "floor", "mapped"} <= set(scored) else []


def summarize_keyed(scores: list[GistScore], *, seed: int = 0, resamples: int = 1000) -> dict:
    """Over the keyed items (``keyed`` set): ``key_n``, ``key_<c>`` the share answered (the key greedy) under each
    condition scored on every one of them, and the paired differences ``key_map_minus_<c>`` (mapped - drop /
    control / each control; ``key_map_minus_controls``: mapped - the best control), each with a bootstrap 95%
    interval over those items.  Empty when no item is keyed."""
    keyed = [s.keyed for s in scores if s.keyed]
    if not keyed:
        return {}
    conditions = [c for c in GIST_CONDITIONS + GIST_CONTROLS if all(c in k for k in keyed)]
    controls = [c for c in ("control", *GIST_CONTROLS) if c in conditions]

    def stats(index) -> dict:
        out = {f"key_{c}": sum(keyed[i][c] for i in index) / len(index) for c in conditions}
        for other in ("drop", *controls):
            if other in conditions:
                out[f"key_map_minus_{other}"] = out["key_mapped"] - out[f"key_{other}"]
        if len(controls) > 1:
            out["key_map_minus_controls"] = min(out[f"key_map_minus_{c}"] for c in controls)
        return out

    return {"key_n": len(keyed), **with_intervals(stats, len(keyed), seed=seed, resamples=resamples)}


def read_gist_score(
    record: dict, *, required: tuple = GIST_CONDITIONS, generated: bool = False, judged: bool = False
) -> GistScore:
    """A cached GistScore; one without a ``required`` condition scored now (written before ``drop``, or before the
    ``zero`` control where the backend asks for it), or, with ``generated``, without every one of them scored by
    generation too (written before generation was), or with ``judged``, without every one judged and its answer
    kept by this judge's wording (:func:`kvhub.eval.judge.judge_key`), is refused (ValueError), so the per-item cache scores that item again."""
    if any(c not in record.get("nll", {}) for c in required):
        raise ValueError("record without a condition scored now")
    if generated and any(c not in record.get("rouge", {}) for c in required):
        raise ValueError("record without the generation scores")
    if judged and any(c not in record.get("judged", {}) or c not in record.get("written", {}) for c in required):
        raise ValueError("record without the judge's scores")
    if judged:
        from kvhub.eval.judge import judge_key

        if record.get("meta", {}).get("judge") != judge_key():
            raise ValueError("record of another judge's wording")
    return GistScore(**record)


class GistTask:
    """A gist task at one context length, as :func:`kvhub.eval.run.run_task` runs it (:class:`kvhub.eval.run.Task`),
    scored through ``conditions`` (:class:`kvhub.eval.conditions.Conditions`); ``task`` is one of
    :data:`kvhub.eval.catalog.GIST_TASKS`; ``items``: these instead of ``limit`` built ones."""

    def __init__(self, task: str, conditions, *, context_tokens: int, limit: int, seed: int = 0, items=None):
        self.task, self.conditions, self.context_tokens, self.limit, self.seed = (
            task,
            conditions,
            context_tokens,
            limit,
            seed,
        )
        self.kind = task.removeprefix("gist-")
        self.name = f"{task}-{context_tokens}"
        self._items = items
        self.read_score = conditions.read_gist

    @classmethod
    def tasks(cls, name: str, conditions, options) -> list:
        """One task per length of ``options`` (:class:`kvhub.eval.conditions.TaskOptions`)."""
        return [
            cls(name, conditions, context_tokens=length, limit=options.limit, seed=options.seed)
            for length in options.context_tokens
        ]

    def items(self) -> list[GistItem]:
        """``limit`` built items, each with its wrong document: the next item the same generator builds (one more
        is built for the last; the first where the generator has no more), so an item's control never depends
        on ``limit``."""
        if self._items is not None:
            return list(self._items)
        built = gist_items(
            self.kind, self.conditions.tokenizer, context_tokens=self.context_tokens, n=self.limit + 1, seed=self.seed
        )
        items = built[: self.limit]
        items = with_wrong_documents(items, [built[(i + 1) % len(built)] for i in range(len(items))])
        self.conditions.check_items(items, extra=ANSWER_TOKENS, context_tokens=self.context_tokens)
        return items

    def score(self, item: GistItem, variants) -> list[GistScore]:
        return self.conditions.gist(item, list(variants))

    def summarize(self, scores: list[GistScore]) -> dict:
        return self.conditions.summarize_gist(
            scores, seed=self.seed, task=self.task, context_tokens=self.context_tokens
        )

    def record(self, variant: str, item: GistItem, score: GistScore) -> dict:
        return self.conditions.gist_record(self.name, variant, item, score)

    def dataset(self, items) -> dict:
        from kvhub.eval.results import items_sha256

        return {
            "name": self.name,
            "origin": f"built by kvhub.eval.gist (seed {self.seed})",
            "context_tokens": self.context_tokens,
            "n": len(items),
            "sha256": items_sha256(items),
        }
