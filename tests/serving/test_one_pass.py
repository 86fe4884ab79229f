"""The one-pass escalation (issue 45): the recompute pass also runs the last prompt token, and select=source
scores from the source's own prefill; both against the two-pass path they replace."""

import pytest
import torch

from kvhub.core.capture import cache_kwargs, run_model
from kvhub.core.last_queries import LastQueryAttention
from kvhub.errors import ConfigError
from kvhub.serving.handoff import escalate, handoff, prepare_cache_counted
from kvhub.serving.recompute import Recompute, cropped, query_attention, recompute_set
from tests.tinymodels import exact_family_target, make_model, variant_model
from tests.tolerances import rtol
from tests.fixtures_fit import fit_tiny, token_ids as _ids

SPEC = Recompute(exact_prefix=2, exact_suffix=3, exact_budget=0.25, select="source", queries=4)


@pytest.fixture(scope="module")
def family():
    """A fitted (not exact: lambda 1e-2, few rows) map, so mapped and exact K/V differ and the recompute matters."""
    torch.manual_seed(0)
    source = make_model("qwen2", num_hidden_layers=3)
    target, _ = exact_family_target(source, insert_before=(1,), kv_repeat=2, double_head_dim=True)
    for p in target.parameters():  # leave the exact family: the map is then approximate
        p.data += 0.02 * torch.randn_like(p)
    mapper = fit_tiny(source, target, train=(8, 24), heldout=(2, 24), ridge_lambda=1e-2)
    return source, target, mapper


def _tolerance(model) -> float:
    return rtol(torch.float32, terms=model.config.intermediate_size * model.config.num_hidden_layers)


def _appended_pass(target, cache, context, positions):
    """The two-pass reference (kvhub before issue 45): the recomputed tokens appended after the cache under the
    (R, T + R) mask 'mapped j < t not in R, or recomputed t' <= t', copied back over the mapped K/V."""
    tokens, count = context.shape[1], positions.numel()
    in_set = torch.zeros(tokens, dtype=torch.bool)
    in_set[positions] = True
    to_cache = (torch.arange(tokens)[None, :] < positions[:, None]) & ~in_set[None, :]
    allowed = torch.cat([to_cache, torch.ones(count, count, dtype=torch.bool).tril()], dim=1)
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    target.base_model(
        input_ids=context[:, positions], position_ids=positions[None], attention_mask=mask[None, None],
        use_cache=True, **cache_kwargs(target.base_model, cache),
    )  # fmt: skip
    for layer in cache.layers:
        layer.keys = layer.keys[:, :, :tokens].index_copy(2, positions, layer.keys[:, :, tokens:])
        layer.values = layer.values[:, :, :tokens].index_copy(2, positions, layer.values[:, :, tokens:])


def _close(got, want, tolerance, what):
    got, want = got.detach(), want.detach()
    scale = float(want.abs().max())
    assert torch.allclose(got, want, rtol=tolerance, atol=tolerance * scale), what


def test_one_pass_gives_the_two_pass_cache_and_first_logits(family):
    """escalate's single target pass (recomputed positions written in place, the last prompt token in the same
    pass) equals the two-pass reference: the appended masked pass, then a forward of the last token for the
    first logits; cache and logits to fp32 tolerance, for a selective spec and for a prefix/suffix-only one.
    Planted bugs caught: the last token attending to the mapped instead of the recomputed K/V (the write after
    the attention), a mask off by one position (a recomputed token not seeing itself, or seeing later ones),
    the last token's K/V left in the cache (n positions, generate re-feeds), the logits of the wrong row."""
    source, target, mapper = family
    ids = _ids(1, 40, 7)
    context = ids[:, :-1]
    for spec in (SPEC, Recompute(exact_prefix=3, exact_suffix=5)):
        done = escalate(mapper, source, target, ids, recompute=spec)
        assert done.cache.get_seq_length() == 39 and done.logits.shape == (1, target.config.vocab_size)
        reference = mapper.transfer(run_model(source, context))
        _appended_pass(target, reference, context, done.positions)
        _close(torch.stack([l.keys for l in done.cache.layers]), torch.stack([l.keys for l in reference.layers]),
               _tolerance(target), "keys")  # fmt: skip
        _close(torch.stack([l.values for l in done.cache.layers]),
               torch.stack([l.values for l in reference.layers]), _tolerance(target), "values")  # fmt: skip
        with torch.no_grad():
            want = target(input_ids=ids[:, -1:], position_ids=torch.tensor([[39]]), use_cache=True,
                          **cache_kwargs(target, reference)).logits[:, -1]  # fmt: skip
        _close(done.logits, want, _tolerance(target), "first logits")
        assert 0 < done.positions.numel() < 39


def test_whole_context_recomputed_in_one_pass_is_the_targets_own_prefill(family):
    """Known answer: with every context position in R, the one pass is the target's own prefill, cache and first
    logits.  Planted bugs caught: mapped K/V leaking into the attention of recomputed tokens; positions shifted."""
    from kvhub.serving.recompute import recompute_positions

    source, target, mapper = family
    ids = _ids(1, 30, 3)
    context = ids[:, :-1]
    cache = mapper.transfer(run_model(source, context))
    logits, last = recompute_positions(target, cache, context, torch.arange(29), last=ids[:, -1:])
    own = run_model(target, context)
    _close(torch.stack([l.keys for l in cache.layers]), torch.stack([l.keys for l in own.layers]),
           _tolerance(target), "keys")  # fmt: skip
    with torch.no_grad():
        _close(logits, target(ids).logits[:, -1], _tolerance(target), "logits")
    assert len(last) == target.config.num_hidden_layers and last[0][0].shape[2] == 1


@pytest.mark.parametrize("held", [None, 1], ids=["batched", "reduced-per-layer"])
@pytest.mark.parametrize("variant", ["qwen2", "qwen3", "llama3", "mistral-sliding", "gpt_neox-partial"])
def test_prefill_attention_equals_the_second_source_pass(variant, held, monkeypatch):
    """LastQueryAttention collects, during the prefill, the attention the last Q queries pay: the same (Q, T)
    matrix the second source pass (query_attention over the cropped cache) measures, in every RoPE / window
    variant, and the prefill's cache is unchanged by it.  Planted bugs caught: queries taken from the first
    rows, a causal mask off by one, a sliding window ignored, GQA heads paired with the wrong KV head,
    the model's attention implementation not restored, a group reduced twice or lost when the held logits
    pass their bound (``held=1``: every layer reduced as it runs)."""
    if held is not None:
        monkeypatch.setattr("kvhub.core.last_queries._HELD_ELEMENTS", held)
    model = make_model("qwen2") if variant == "qwen2" else variant_model(variant)
    ids = _ids(1, 36, 11)
    with LastQueryAttention(model, queries=6) as scored:
        cache = run_model(model, ids)
    assert model.config._attn_implementation == "eager"
    plain = run_model(model, ids)
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(cache.layers, plain.layers))
    want = query_attention(model, ids, cropped(plain, 30), queries=6)
    _close(scored.attention[0], want, _tolerance(model), "attention")


def test_selection_from_the_prefill_equals_selection_by_the_source_pass(family):
    """The spans chosen from the prefill's attention equal those the second source pass chooses, over several
    prompts; a source_attention of the wrong shape is refused by name.  Planted bugs caught: the scores of
    the wrong queries count, the selection ignoring source_attention (a pass still runs: counted below)."""
    source, target, mapper = family
    calls: list[int] = []
    for seed in range(4):
        ids = _ids(1, 48, 20 + seed)
        context = ids[:, :-1]
        plain = run_model(source, context)
        mapped = mapper.transfer(plain)
        common = dict(context=context, mapped_cache=mapped, source_model=source, target_model=target)
        by_pass = recompute_set(SPEC, source_cache=plain, **common)
        with LastQueryAttention(source, queries=SPEC.queries) as scored:
            run_model(source, context)
        handle = source.base_model.register_forward_pre_hook(lambda *a: calls.append(1))
        try:
            from_prefill = recompute_set(SPEC, source_cache=plain, source_attention=scored.attention[0], **common)
        finally:
            handle.remove()
        assert torch.equal(by_pass, from_prefill) and calls == []
    with pytest.raises(ConfigError, match="source_attention has shape"):
        recompute_set(SPEC, source_cache=plain, source_attention=torch.zeros(3, 47), **common)


def test_handoff_runs_each_model_once_and_generates_what_the_two_pass_path_does(family):
    """handoff(max_new_tokens=1) runs the source body once (its prefill, which also scores) and the target
    body once (the recompute pass with the first token), against 2 and 2 before; longer greedy generations,
    with a repetition penalty, and seeded sampling give what generate gives from prepare_cache's cache
    (two passes).  Planted bugs caught: a second source pass for the selection, a separate first-token
    forward, logits processors skipped on the first token, the first token's K/V missing from the cache
    (later tokens then differ)."""
    source, target, mapper = family
    ids = _ids(1, 40, 5)
    counts = {"source": 0, "target": 0}
    hooks = [
        source.base_model.register_forward_pre_hook(lambda *a: counts.__setitem__("source", counts["source"] + 1)),
        target.base_model.register_forward_pre_hook(lambda *a: counts.__setitem__("target", counts["target"] + 1)),
    ]
    try:
        handoff(mapper, source, target, ids, recompute=SPEC, max_new_tokens=1, do_sample=False)
    finally:
        for hook in hooks:
            hook.remove()
    assert counts == {"source": 1, "target": 1}
    settings = [
        dict(max_new_tokens=6, do_sample=False),
        dict(max_new_tokens=6, do_sample=False, repetition_penalty=1.5),
        dict(max_new_tokens=6, do_sample=True, top_k=20, seed=3),
    ]
    for setting in settings:
        seed = setting.pop("seed", None)
        cache, _ = prepare_cache_counted(mapper, source, target, ids, recompute=SPEC)
        torch.manual_seed(seed or 0)
        want = target.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(target, cache), **setting)
        torch.manual_seed(seed or 0)
        got = handoff(mapper, source, target, ids, recompute=SPEC, **setting)
        assert torch.equal(got, want), setting
    assert "forward" not in target.__dict__  # the first-forward answer is removed after generate


def test_batched_handoff_stacks_rows_with_their_first_logits(family):
    """A batch of 2 with a selective spec: each row escalated alone, caches and first logits stacked; the output
    equals each row's own handoff.  Planted bugs caught: the last-token K/V of row 0 used for row 1."""
    source, target, mapper = family
    ids = _ids(2, 32, 9)
    both = handoff(mapper, source, target, ids, recompute=SPEC, max_new_tokens=4, do_sample=False)
    for row in range(2):
        alone = handoff(mapper, source, target, ids[row : row + 1], recompute=SPEC, max_new_tokens=4, do_sample=False)
        assert torch.equal(both[row : row + 1], alone)
