"""Known answers for the recompute pass the vLLM connector runs with the engine's model
(kvhub.serving.engine_pass): its masked attention, and which positions a request recomputes.
The pass through a real vLLM model is compared with transformers in tests/serving/test_vllm_connector.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvhub.serving.engine_pass import (
    PassResult,
    exact_positions,
    load_counts,
    masked_attention,
    prompt_attention,
    recompute_request,
    stale_source_attention,
)
from kvhub.serving.spec import Recompute


def _qkv(n: int, heads_q: int = 4, heads_kv: int = 2, dim: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, heads_q, dim, generator=g),
        torch.randn(n, heads_kv, dim, generator=g),
        torch.randn(n, heads_kv, dim, generator=g),
    )


def test_with_no_cache_the_pass_is_causal_attention():
    q, k, v = _qkv(7)
    out, probs = masked_attention(
        q, k, v, torch.arange(7), k[:0].transpose(0, 1), v[:0].transpose(0, 1), scale=0.3, attention_rows=7
    )
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1).repeat_interleave(2, 0),
        v.transpose(0, 1).repeat_interleave(2, 0),
        is_causal=True,
        scale=0.3,
    )
    torch.testing.assert_close(out, expected.transpose(0, 1))
    assert torch.allclose(probs.sum(-1), torch.ones(4, 7))


def test_recomputed_tokens_see_cached_tokens_before_them_and_recomputed_ones_up_to_themselves():
    """The rule of kvhub.serving.recompute, written out per query: j < t from the cache unless j is
    recomputed, then its fresh K/V; t itself fresh; nothing after t."""
    cached_k, cached_v = torch.randn(2, 10, 8), torch.randn(2, 10, 8)
    positions = torch.tensor([2, 5, 6])
    q, k, v = _qkv(3, seed=1)
    out, _ = masked_attention(q, k, v, positions, cached_k, cached_v, scale=0.5)
    for i, t in enumerate(positions.tolist()):
        keys, values = [], []
        for j in range(t + 1):
            fresh = (positions == j).nonzero()
            keys.append(k[fresh.item()] if fresh.numel() else cached_k[:, j])
            values.append(v[fresh.item()] if fresh.numel() else cached_v[:, j])
        keys, values = torch.stack(keys, 1).repeat_interleave(2, 0), torch.stack(values, 1).repeat_interleave(2, 0)
        weights = (q[i][:, None, :] @ keys.transpose(1, 2) * 0.5).softmax(-1)  # (H, 1, t + 1)
        torch.testing.assert_close(out[i], (weights @ values)[:, 0], rtol=1e-5, atol=1e-5)


def _explicit(q, k, v, positions, cached_k, cached_v, scale):
    """The rule written as one dense masked softmax (the formula the fused pass replaced)."""
    total = max(cached_k.shape[1], int(positions.max()) + 1)
    keys, values = torch.zeros(cached_k.shape[0], total, cached_k.shape[2]), torch.zeros(cached_k.shape[0], total, 8)
    keys[:, : cached_k.shape[1]], values[:, : cached_k.shape[1]] = cached_k, cached_v
    keys[:, positions], values[:, positions] = k.transpose(0, 1), v.transpose(0, 1)
    group = q.shape[1] // cached_k.shape[0]
    scores = q.transpose(0, 1) @ keys.repeat_interleave(group, 0).transpose(1, 2) * scale
    allowed = torch.arange(total)[None, :] <= positions[:, None]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return (probs @ values.repeat_interleave(group, 0)).transpose(0, 1), probs


@pytest.mark.parametrize("chunk", [1, 3, 128])
def test_chunked_queries_read_only_the_keys_up_to_their_last_position_and_give_the_dense_answer(monkeypatch, chunk):
    """Chunks of sorted queries each attend to a prefix of the keys: the output (and the asked rows) equal
    the dense masked softmax whatever the chunk size, with positions scattered and some past the cache."""
    monkeypatch.setattr("kvhub.serving.engine_pass.QUERY_CHUNK", chunk)
    cached_k, cached_v = torch.randn(2, 30, 8), torch.randn(2, 30, 8)
    positions = torch.tensor([0, 4, 5, 11, 17, 18, 29, 30, 31])
    q, k, v = _qkv(9, seed=3)
    out, rows = masked_attention(q, k, v, positions, cached_k, cached_v, scale=0.4, attention_rows=3)
    expected, probs = _explicit(q, k, v, positions, cached_k, cached_v, 0.4)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rows, probs[:, -3:], rtol=1e-5, atol=1e-6)


def test_positions_past_the_cache_must_extend_it_without_a_gap():
    q, k, v = _qkv(2)
    with pytest.raises(ValueError, match="without a gap"):
        masked_attention(q, k, v, torch.tensor([10, 12]), torch.randn(2, 10, 8), torch.randn(2, 10, 8), scale=1.0)


class _Recorder:
    """Stands in for EnginePass: records each pass and answers the selection pass with planted attention."""

    def __init__(self, attention: torch.Tensor):
        self.attention, self.calls = attention, []

    def run(self, ids, positions, cached, *, attention_rows=0):
        self.calls.append((positions.tolist(), attention_rows))
        rows = self.attention[-attention_rows:] if attention_rows else None
        return PassResult([(torch.zeros(len(ids), 2, 8), torch.zeros(len(ids), 2, 8))], rows)


def test_a_request_recomputes_its_prefix_and_the_spans_its_last_tokens_attend_to():
    prompt, end = list(range(1, 61)), 48  # the engine computes [48, 60) itself
    attention = torch.full((12, 48), 0.01)
    attention[-1, 30] = 5.0  # the last query looks one token up
    engine = _Recorder(attention)
    spec = Recompute(exact_prefix=4, exact_suffix=16, exact_budget=0.1, select="target", spans="token", queries=4)
    done = recompute_request(
        engine, spec, prompt_ids=prompt, start=0, end=end, cached=lambda i: (torch.zeros(2, end, 8),) * 2
    )
    assert engine.calls[0] == (list(range(48, 60)), 4)  # the selection pass: the tail, its last 4 rows scored
    assert 30 in done.positions.tolist() and done.positions[:4].tolist() == [0, 1, 2, 3]
    assert done.prefix == 4 and done.selected == round(0.1 * 59) and len(done.positions) == 4 + done.selected
    assert engine.calls[1][0] == done.positions.tolist()  # one recompute pass of exactly those positions
    # tokens vLLM already had (its own prefix cache hit, [0, start)) are never recomputed
    done = recompute_request(
        _Recorder(attention), spec, prompt_ids=prompt, start=16, end=end, cached=lambda i: (torch.zeros(2, end, 8),) * 2
    )
    assert done.prefix == 0 and min(done.positions.tolist()) >= 16


def test_the_random_control_spends_the_same_budget_and_source_without_attention_is_refused():
    prompt, end = list(range(1, 101)), 80
    spec = Recompute(exact_suffix=20, exact_budget=0.2, select="random", spans="token")
    done = recompute_request(
        _Recorder(torch.zeros(1, 80)),
        spec,
        prompt_ids=prompt,
        start=0,
        end=end,
        cached=lambda i: (torch.zeros(2, end, 8),) * 2,
    )
    assert done.selected == round(0.2 * 99) and done.prefix == 0
    from kvhub.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="select=source with the small model's attention"):
        recompute_request(
            _Recorder(torch.zeros(1, 80)),
            Recompute(exact_budget=0.2, select="source"),
            prompt_ids=prompt,
            start=0,
            end=end,
            cached=lambda i: (torch.zeros(2, end, 8),) * 2,
        )


def test_block_rounding_of_the_tail_comes_out_of_the_budget():
    """n = 100, exact suffix 16, but the engine computes [64, 100) = 36 tokens: 20 more than asked, taken
    from round(0.3 * 99) = 30, so 10 are selected; prefix + selected + tail = 4 + 10 + 36 = 50 = 4 + 30 + 16."""
    spec = Recompute(exact_prefix=4, exact_suffix=16, exact_budget=0.3, select="random", spans="token")
    done = recompute_request(
        _Recorder(torch.zeros(1, 64)),
        spec,
        prompt_ids=list(range(1, 101)),
        start=0,
        end=64,
        cached=lambda i: (torch.zeros(2, 64, 8),) * 2,
    )
    assert done.selected == 10 and done.prefix == 4


def test_a_load_counts_the_positions_it_computed_not_the_spec():
    """n = 100, cache [0, 64): budget round(0.4 * 99) - 20 (rounding) = 20 tokens, but whole 16-token spans are
    taken while they fit: the attended span [32, 48) and no other, so R = [0, 4) + [32, 48) and the large model
    computes R and the tail [64, 99) = 55 context positions, not the spec's 4 + 20 + 36.  ``exact`` has the
    type of prepare_cache_counted's positions (sorted, long, CPU); the connector's report counts them.  Planted
    bugs caught: a count inferred from the budget, the tail left out of ``exact``, the last prompt token
    counted in it, or a report counting the pass and the tail as |R| + n - end."""
    attention = torch.full((12, 64), 0.01)
    attention[-1, 40] = 5.0
    spec = Recompute(exact_prefix=4, exact_suffix=16, exact_budget=0.4, select="target", spans="sentence", queries=4)
    done = recompute_request(
        _Recorder(attention),
        spec,
        prompt_ids=list(range(1, 101)),
        start=0,
        end=64,
        cached=lambda i: (torch.zeros(2, 64, 8),) * 2,
    )
    assert done.positions.tolist() == [0, 1, 2, 3] + list(range(32, 48)) and done.selected == 16
    assert done.exact.tolist() == [0, 1, 2, 3] + list(range(32, 48)) + list(range(64, 99))
    assert done.exact.dtype == torch.long and done.exact.device.type == "cpu"
    assert exact_positions(torch.empty(0, dtype=torch.long), end=64, tokens=100).tolist() == list(range(64, 99))
    assert load_counts(done.positions, done.exact, tokens=100) == {
        "recomputed_tokens": 20,
        "exact_tokens": 55,
        "exact_fraction": 55 / 99,
    }


def test_rerunning_the_last_tokens_over_their_own_cache_gives_the_prefills_attention_rows():
    """The producer's source attention (prompt_attention): the last Q tokens re-run at their positions over
    the prompt's full K/V (their own among it) attend exactly as in the causal prefill: the rows of the
    full causal softmax, and the output of causal attention (planted: a pass that let them see later
    tokens, or not at all their own position, differs)."""
    q, k, v = _qkv(12, seed=4)
    out, probs = masked_attention(
        q[-5:], k[-5:], v[-5:], torch.arange(7, 12), k.transpose(0, 1), v.transpose(0, 1), scale=0.4, attention_rows=3
    )
    keys, values = k.transpose(0, 1).repeat_interleave(2, 0), v.transpose(0, 1).repeat_interleave(2, 0)
    scores = q.transpose(0, 1) @ keys.transpose(1, 2) * 0.4  # (H, 12, 12)
    causal = scores.masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    torch.testing.assert_close(probs, causal[:, -3:])  # the last 3 of the pass's 5 rows
    torch.testing.assert_close(out, (causal @ values)[:, -5:].transpose(0, 1))


def test_prompt_attention_asks_the_engine_for_the_last_rows_and_returns_them():
    attention = torch.rand(16, 40)
    engine = _Recorder(attention)
    rows = prompt_attention(engine, list(range(1, 41)), lambda i: (torch.zeros(2, 40, 8),) * 2, queries=16)
    assert engine.calls == [(list(range(24, 40)), 16)]
    torch.testing.assert_close(rows, attention)
    short = prompt_attention(
        _Recorder(attention[:, :6]), list(range(6)), lambda i: (torch.zeros(2, 6, 8),) * 2, queries=16
    )
    assert short.shape == (6, 6)  # a prompt shorter than the queries: every token is one


def test_select_source_chooses_by_the_stored_attention_and_runs_no_selection_pass():
    prompt, end = list(range(1, 61)), 48
    stored = torch.full((16, 60), 0.01)  # the producer's rows over the whole 60-token prompt
    stored[-2, 20] = 5.0  # one of the last 4 queries looks one token up
    stored[0, 33] = 9.0  # an older query, outside spec.queries: ignored
    target = torch.full((12, 48), 0.01)
    target[-1, 40] = 5.0  # what the large model would have chosen
    engine = _Recorder(target)
    spec = Recompute(exact_prefix=4, exact_suffix=16, exact_budget=0.05, select="source", spans="token", queries=4)
    done = recompute_request(
        engine,
        spec,
        prompt_ids=prompt,
        start=0,
        end=end,
        cached=lambda i: (torch.zeros(2, end, 8),) * 2,
        source_attention=stored,
    )
    chosen = done.positions.tolist()
    assert 20 in chosen and 33 not in chosen and 40 not in chosen
    assert [attention_rows for _, attention_rows in engine.calls] == [0]  # the recompute pass only


def test_in_bf16_the_pass_stays_close_to_the_float32_one_and_keeps_its_dtype():
    """The engine's dtype end to end (no float32 copy of the layer): bf16 output within bf16 rounding of the
    float32 pass, probabilities still float32 and normalised."""
    cached_k, cached_v = torch.randn(2, 64, 16), torch.randn(2, 64, 16)
    positions = torch.tensor([3, 10, 40, 64, 65])  # two of them extend the cache
    q, k, v = (t.repeat(1, 1, 2) for t in _qkv(5, seed=2))
    exact, exact_rows = masked_attention(q, k, v, positions, cached_k, cached_v, scale=0.25, attention_rows=2)
    half = [t.bfloat16() for t in (q, k, v, cached_k, cached_v)]
    out, rows = masked_attention(*half[:3], positions, *half[3:], scale=0.25, attention_rows=2)
    assert out.dtype == torch.bfloat16 and rows.dtype == torch.float32 and rows.shape == (4, 2, 66)
    torch.testing.assert_close(out.float(), exact, rtol=0.05, atol=0.05)
    torch.testing.assert_close(rows, exact_rows, rtol=0.05, atol=0.02)
    torch.testing.assert_close(rows.sum(-1), torch.ones(4, 2))


def test_stored_attention_chooses_only_for_the_prompt_it_was_computed_on():
    """The stored rows are the stored prompt's last tokens: a prompt that extends it by more than the exact
    suffix (a later turn) has another question, and the large model's attention chooses instead."""
    spec = Recompute(exact_suffix=16, exact_budget=0.1, select="source")
    assert stale_source_attention(torch.rand(16, 100), prompt_tokens=100, spec=spec) == ""
    assert stale_source_attention(torch.rand(16, 100), prompt_tokens=116, spec=spec) == ""  # the template tail
    assert "117 tokens before" in stale_source_attention(torch.rand(16, 100), prompt_tokens=217, spec=spec)
    assert stale_source_attention(None, prompt_tokens=100, spec=spec).startswith("no source attention")
