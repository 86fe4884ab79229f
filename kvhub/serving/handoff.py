"""Escalate a prompt from the source model to the target model through a Mapper.

The source covers tokens [0, n-1); the mapped cache holds n-1 positions; the target consumes token
n-1 itself and produces the first logits.  (A cache that covered every input token would make
``generate`` silently re-feed the prompt.)  The target can recompute some context tokens itself, over
the mapped rest (:mod:`kvhub.serving.recompute`):

- ``exact_prefix=p``: the first p tokens (attention sinks);
- ``exact_suffix=r``: the last r context tokens, the ones nearest to what the target generates next;
- ``exact_budget=f`` with ``select=``: a fraction f of the context in whole sentences / lines, chosen
  by a signal available at handoff time (by default the source's attention from the last tokens).

With p + r >= n-1 the cache is exactly the target's own.  :func:`handoff` recomputes the first 4, the
last 16 and 8% of the context chosen by the source's attention by default (DEFAULT_EXACT_PREFIX /
DEFAULT_EXACT_SUFFIX / DEFAULT_EXACT_BUDGET / DEFAULT_SELECT), under 10% of a context of 1k tokens or
more in all: the map with the first 4 + last 16 exact loses a fact stated once in the context, the
selective recompute brings it back, at a time to first token several times below a full prefill
(docs/benchmarks.md, section 4, has the figures and the commands).  :func:`prepare_cache` maps
everything unless asked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvhub.core.capture import cache_kwargs, run_model
from kvhub.errors import ConfigError, IncompatibleError
from kvhub.core.fingerprint import kv_geometry
from kvhub.core.layer_kinds import check_attention_layers
from kvhub.core.last_queries import LastQueryAttention
from kvhub.serving.recompute import (
    Recompute,
    budget_tokens,
    cropped,
    recompute_positions,
    recompute_set,
    selection_queries,
)
from kvhub.serving.spec import DEFAULT_EXACT_BUDGET, DEFAULT_EXACT_PREFIX, DEFAULT_EXACT_SUFFIX, DEFAULT_SELECT


# Config fields whose change changes a model's KV cache (or the context it encodes): check_models compares
# them with the fingerprint's recorded config, wherever both configs have them.
COMPATIBILITY_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "partial_rotary_factor",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
    "rms_norm_eps",
    "hidden_act",
)


def check_models(mapper, source_model, target_model, *, tokenizer=None) -> None:
    """Refuse models whose KV geometry, model type or a config field of :data:`COMPATIBILITY_FIELDS` (or,
    when given, tokenizer) differs from what the mapper was fitted for; the error names the field."""
    if tokenizer is not None:
        from kvhub.core.fingerprint import tokenizer_hash

        given, fitted = tokenizer_hash(tokenizer), mapper.source.get("tokenizer_hash")
        if fitted is not None and given != fitted:
            raise IncompatibleError(
                f"the tokenizer passed (sha256 {given[:12]}) is not the one of {mapper.source['model_id']} and "
                f"{mapper.target['model_id']} (sha256 {fitted[:12]}) this mapper was fitted with; "
                "the mapped cache would hold the wrong tokens"
            )
    for side, model in (("source", source_model), ("target", target_model)):
        expected = mapper.metadata[side]
        got = kv_geometry(model.config)
        want = (expected["num_layers"], expected["num_kv_heads"], expected["head_dim"])
        if got != want or model.config.model_type != expected["model_type"]:
            raise IncompatibleError(
                f"the {side} model ({model.config.model_type}, layers/kv_heads/head_dim {got}) is not the one "
                f"this mapper was fitted for ({expected['model_id']}: {expected['model_type']}, {want})"
            )
        _check_config(side, expected, model.config)


def _check_config(side: str, fingerprint: dict, config) -> None:
    import json

    from kvhub.core.fingerprint import reduced_config

    def normal(value):  # tuples and lists, ints and floats compare as mapper.json stores them
        return json.loads(json.dumps(value, sort_keys=True, default=str))

    fitted, given = fingerprint.get("config") or {}, reduced_config(config)
    for field in COMPATIBILITY_FIELDS:
        if field in fitted and field in given and normal(fitted[field]) != normal(given[field]):
            raise IncompatibleError(
                f"the {side} model's config has {field}={given[field]!r}, but this mapper was fitted for "
                f"{fingerprint['model_id']} with {field}={fitted[field]!r}; load that model (the mapped cache "
                "would be wrong)"
            )


@torch.no_grad()
def prepare_cache(
    mapper,
    source_model,
    target_model,
    input_ids: torch.Tensor,
    *,
    recompute: Recompute | None = None,
    tokenizer=None,
    source_cache=None,
):
    """Target cache for input_ids[:, :-1]: mapped from the source, then the context tokens ``recompute``
    (a :class:`~kvhub.serving.spec.Recompute`; None: map only) names recomputed by the target itself over
    the mapped rest (:mod:`kvhub.serving.recompute`).

    input_ids: (B, n) with n >= 2, no padding (B = 1 for a selective spec).  ``tokenizer`` (optional)
    lets selected spans follow sentences and lines.  source_cache: the source model's cache of (at
    least) input_ids[:, :-1] when the caller has it (a serving stack does); else it is computed.
    Returns a target DynamicCache of n-1 positions (:func:`prepare_cache_counted` also says which
    positions the target recomputed).
    """
    return prepare_cache_counted(
        mapper,
        source_model,
        target_model,
        input_ids,
        recompute=recompute or Recompute(),
        tokenizer=tokenizer,
        source_cache=source_cache,
    )[0]


@torch.no_grad()
def prepare_cache_counted(
    mapper,
    source_model,
    target_model,
    input_ids: torch.Tensor,
    *,
    recompute: Recompute,
    tokenizer=None,
    source_cache=None,
    source_attention: torch.Tensor | None = None,
):
    """(:func:`prepare_cache`'s cache, the context positions (sorted, long, on the CPU) the target recomputed
    exactly): what a report counts as recomputed, rather than what the spec asked for (whole spans are taken
    while they fit the budget, so a selection can hold fewer tokens).  ``source_attention``: see
    :func:`escalate`."""
    done = escalate(
        mapper,
        source_model,
        target_model,
        input_ids,
        recompute=recompute,
        tokenizer=tokenizer,
        source_cache=source_cache,
        source_attention=source_attention,
        first_logits=False,
    )
    return done.cache, done.positions


@dataclass
class Escalation:
    """What :func:`escalate` built: ``cache``, the target cache of the n-1 context positions; ``positions``, the
    context positions the target recomputed (sorted, long, CPU); and, when the recompute pass also ran the
    prompt's last token, ``logits`` (B, V), its first logits, and ``last``, that token's (keys, values)
    (B, H, 1, D) per layer (not in ``cache``: :func:`generate_from` appends them where generate expects them)."""

    cache: object
    positions: torch.Tensor
    logits: torch.Tensor | None = None
    last: list | None = None


@torch.no_grad()
def escalate(
    mapper,
    source_model,
    target_model,
    input_ids: torch.Tensor,
    *,
    recompute: Recompute,
    tokenizer=None,
    source_cache=None,
    source_attention: torch.Tensor | None = None,
    first_logits: bool = True,
) -> Escalation:
    """The escalation of ``input_ids`` (B, n) to the target: map the source cache of the context (the first n-1
    tokens), choose what ``recompute`` recomputes, and recompute it in ONE target pass that also runs the last
    prompt token (``first_logits``), so the first logits need no second forward
    (:func:`kvhub.serving.recompute.recompute_positions`).

    source_cache: the source's cache of (at least) input_ids[:, :-1] when the caller has it (a serving
    stack does); else the source prefills the context here, and with select=source the same prefill yields
    the selection's attention (:class:`kvhub.core.last_queries.LastQueryAttention`), so no second source pass
    runs.  source_attention: that (Q, T) attention when the caller's prefill collected it (with
    ``LastQueryAttention(source_model, queries=selection_queries(spec, n - 1))``); else, with a given
    source_cache, the source runs its last Q tokens again to score.  A target with sliding-window layers and a
    context recomputed whole return no logits (generate runs the last token, as before).
    """
    for model in (source_model, target_model):  # hybrids (linear attention, Mamba): refused by layer type
        check_attention_layers(model.config, name=getattr(model.config, "_name_or_path", None) or None)
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ConfigError("handoff needs (batch, n) input ids with n >= 2: the target consumes the last token")
    context = input_ids[:, :-1]
    tokens = context.shape[1]
    spec = recompute
    for name, value in (("exact_prefix", spec.exact_prefix), ("exact_suffix", spec.exact_suffix)):
        if not 0 <= value <= tokens:
            raise ConfigError(f"{name} must be in 0..{tokens} (the context minus its last token), got {value}")
    check_models(mapper, source_model, target_model, tokenizer=tokenizer)
    if spec.exact_prefix + spec.exact_suffix >= tokens:  # nothing left to map: the target's own cache
        return Escalation(run_model(target_model, context), torch.arange(tokens))
    if source_cache is None:
        source_cache, source_attention = source_prefill(source_model, context, spec, windowed=mapper.windowed_target())
    if mapper.windowed_target():
        if spec.selective:
            raise ConfigError(
                "selective recompute needs a target whose layers all keep the whole context; "
                f"{mapper.target['model_id']} has sliding-window layers: use exact_budget=0"
            )
        cache = _windowed_prefix_suffix(mapper, target_model, context, source_cache, spec)
        positions = torch.cat([torch.arange(spec.exact_prefix), torch.arange(tokens - spec.exact_suffix, tokens)])
        return Escalation(cache, positions)
    whole = source_cache if source_cache.get_seq_length() == tokens else cropped(source_cache, tokens)
    cache = mapper.transfer(whole, dtype=target_model.dtype)
    positions = recompute_set(
        spec,
        context=context,
        mapped_cache=cache,
        source_model=source_model,
        target_model=target_model,
        source_cache=source_cache,
        tokenizer=tokenizer,
        source_attention=source_attention,
    )
    first = recompute_positions(
        target_model, cache, context, positions, last=input_ids[:, -1:] if first_logits else None
    )
    logits, last = first if first is not None else (None, None)
    return Escalation(cache, positions.cpu(), logits, last)


def source_prefill(source_model, context: torch.Tensor, spec: Recompute, *, windowed: bool = False):
    """(the source's cache of ``context``, the (Q, T) attention its last Q tokens paid when select=source
    will choose, else None): one prefill either way, what :func:`escalate` takes as ``source_cache`` and
    ``source_attention``.  ``windowed``: the target has sliding-window layers (no selection: no attention)."""
    if not (spec.selective and spec.select == "source" and not windowed and budget_tokens(spec, context.shape[1])):
        return run_model(source_model, context), None
    with LastQueryAttention(source_model, queries=selection_queries(spec, context.shape[1])) as scored:
        cache = run_model(source_model, context)
    return cache, scored.attention[0]


def _windowed_prefix_suffix(mapper, target_model, context, source_cache, spec: Recompute):
    """Prefix and suffix recomputes for a target with sliding-window layers (which keep only their last
    tokens, so no masked pass can address a position): map [0, n-1-r), overwrite the first p positions
    where a layer still holds them, then prefill the last r tokens over the mapped cache."""
    tokens = context.shape[1]
    mapped_end = tokens - spec.exact_suffix
    cache = mapper.transfer(cropped(source_cache, mapped_end), dtype=target_model.dtype)
    if spec.exact_prefix:
        exact = run_model(target_model, context[:, : spec.exact_prefix])
        for mapped, own in zip(cache.layers, exact.layers):
            if mapped.keys.shape[-2] == mapped_end:  # sliding layers past their window keep no prefix
                mapped.keys[:, :, : spec.exact_prefix] = own.keys.to(mapped.keys.dtype)
                mapped.values[:, :, : spec.exact_prefix] = own.values.to(mapped.values.dtype)
    if spec.exact_suffix:
        device = next(target_model.parameters()).device
        positions = torch.arange(mapped_end, tokens, device=device).expand(context.shape[0], -1)
        target_model.base_model(
            input_ids=context[:, mapped_end:].to(device),
            position_ids=positions,
            use_cache=True,
            **cache_kwargs(target_model.base_model, cache),
        )
    return cache


@torch.no_grad()
def handoff(
    mapper,
    source_model,
    target_model,
    input_ids: torch.Tensor | None = None,
    *,
    exact_prefix: int = DEFAULT_EXACT_PREFIX,
    exact_suffix: int = DEFAULT_EXACT_SUFFIX,
    exact_budget: float | None = None,
    select: str = DEFAULT_SELECT,
    recompute: Recompute | None = None,
    tokenizer=None,
    **generate_kwargs,
) -> torch.Tensor:
    """Generate with the target from a mapped cache; returns ``target_model.generate``'s output ids.

    input_ids: (B, n), no padding; what the tokenizer returns may be passed as is
    (``handoff(m, src, dst, **tokenizer(text, return_tensors="pt"), max_new_tokens=8)``): an
    ``attention_mask`` of ones is accepted, a padded one refused.  generate_kwargs go to ``generate`` (e.g.
    max_new_tokens, do_sample=False).  Equivalent to ``target_model.generate(input_ids, ...)`` when the map
    is exact.
    ``tokenizer``: the tokenizer that produced input_ids; refused unless it is the one fitted with, and
    used to recompute whole sentences / lines (without it: 16-token windows).
    exact_prefix / exact_suffix / exact_budget / select: see the module docstring and
    :mod:`kvhub.serving.recompute`; capped to the context, so a short prompt is simply prefilled by the target
    (pass 0, 0 and 0.0 to map every token).  exact_budget=None: DEFAULT_EXACT_BUDGET, or 0 for a
    target with sliding-window layers.  ``recompute``: a full :class:`~kvhub.serving.recompute.Recompute`
    spec instead of those four, e.g. ``Recompute.parse("exact_prefix=4,exact_suffix=16,exact_budget=0.08,
    select=target,queries=4")``.  Selection is per sequence: rows of a batch are prepared one by one and
    their caches stacked.
    """
    input_ids = _prompt_ids(input_ids, generate_kwargs.pop("attention_mask", None))
    if exact_budget is None:  # the default; a target with sliding-window layers cannot address positions
        exact_budget = 0.0 if mapper.windowed_target() else DEFAULT_EXACT_BUDGET
    spec = (recompute or Recompute(exact_prefix, exact_suffix, exact_budget, select)).capped(input_ids.shape[1] - 1)
    rows = [input_ids[i : i + 1] for i in range(input_ids.shape[0])] if spec.selective else [input_ids]
    done = [escalate(mapper, source_model, target_model, row, recompute=spec, tokenizer=tokenizer) for row in rows]
    return generate_from(target_model, input_ids, done[0] if len(done) == 1 else _stacked(done), **generate_kwargs)


def generate_from(target_model, input_ids: torch.Tensor, escalation: Escalation, **generate_kwargs) -> torch.Tensor:
    """``target_model.generate(input_ids, ...)`` continuing ``escalation`` (of these ``input_ids`` (B, n)).

    When the escalation computed the first logits, generate's own first forward (the last prompt token over
    the n-1 cached positions) is answered from them: that one call appends the token's K/V to the cache and
    returns the logits, so every generation setting (sampling, logits processors, stopping, streamers) applies
    to the first token exactly as to a forward's.  Any other call goes to the model.  The answer is installed on
    the model for the duration of the call, so one model serves one ``generate_from`` at a time (as one
    ``generate`` with a shared cache would)."""
    device = next(target_model.parameters()).device
    input_ids = input_ids.to(device)
    cache, kwargs = escalation.cache, {"attention_mask": torch.ones_like(input_ids), **generate_kwargs}
    if escalation.logits is None:
        return target_model.generate(input_ids, **cache_kwargs(target_model, cache), **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    own = target_model.__dict__.get("forward")  # an instance forward (accelerate's hooks) stays in place
    forward, tokens, pending = target_model.forward, input_ids.shape[1] - 1, [True]

    def first(*args, **inputs):
        ids = inputs.get("input_ids")
        answer = pending.pop() if pending else False
        if answer and ids is not None and ids.shape[1] == 1 and cache.get_seq_length() == tokens:
            for index, (keys, values) in enumerate(escalation.last):
                cache.update(keys, values, index)
            return CausalLMOutputWithPast(logits=escalation.logits[:, None], **cache_kwargs(target_model, cache))
        return forward(*args, **inputs)

    target_model.forward = first
    try:
        return target_model.generate(input_ids, **cache_kwargs(target_model, cache), **kwargs)
    finally:
        if own is None:
            del target_model.forward
        else:
            target_model.forward = own


def _prompt_ids(input_ids, attention_mask) -> torch.Tensor:
    """The (B, n) prompt ids handoff takes, checked: TypeError for text or a missing prompt (naming what to
    pass), ConfigError for a mask that pads (the mapped cache has no padding positions)."""
    if not isinstance(input_ids, torch.Tensor):
        got = (
            "text" if isinstance(input_ids, str) else "no input_ids" if input_ids is None else type(input_ids).__name__
        )
        raise TypeError(
            f"handoff takes token ids, got {got}: pass input_ids as a (batch, n) tensor, e.g. "
            "handoff(mapper, source, target, **tokenizer(text, return_tensors='pt'), max_new_tokens=32)"
        )
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if attention_mask is not None and not bool((torch.as_tensor(attention_mask) != 0).all()):
        raise ConfigError(
            "handoff takes unpadded prompts (its mapped cache has no padding positions), but the "
            "attention_mask pads some rows: hand off one prompt per call, or prompts of one length"
        )
    return input_ids


def _stacked(done: list[Escalation]) -> Escalation:
    """One Escalation whose batch holds the rows of ``done`` (same length, full-attention layers)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for index in range(len(done[0].cache.layers)):
        cache.update(
            torch.cat([d.cache.layers[index].keys for d in done]),
            torch.cat([d.cache.layers[index].values for d in done]),
            index,
        )
    if any(d.logits is None for d in done):
        return Escalation(cache, done[0].positions)
    last = [
        (torch.cat([d.last[i][0] for d in done]), torch.cat([d.last[i][1] for d in done]))
        for i in range(len(done[0].last))
    ]
    return Escalation(cache, done[0].positions, torch.cat([d.logits for d in done]), last)
