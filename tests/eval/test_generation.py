"""Scoring by generation (kvhub.eval.generation): ROUGE-L known answers, and the batched greedy decoding equal to
transformers' own generate, row by row, whatever the other rows' lengths and positions."""

import copy

import pytest
import torch

from kvhub.core.capture import cache_kwargs, run_model
from kvhub.eval.generation import Row, eos_ids, greedy_rows, rouge_l
from kvhub.eval.gist import own_answer
from kvhub.serving.drop import drop_cache
from tests.tinymodels import make_model


def test_rouge_l_known_answers():
    assert rouge_l([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert rouge_l([1, 2, 3, 4], [1, 3, 4, 5]) == pytest.approx(0.75)  # LCS 1 3 4: 3 of 4 each way
    assert rouge_l([4, 3, 2, 1], [1, 2, 3, 4]) == pytest.approx(0.25)  # order counts: LCS of length 1
    assert rouge_l([1, 1, 1], [1, 2]) == pytest.approx(2 * (1 / 3) * (1 / 2) / (1 / 3 + 1 / 2))
    assert rouge_l([5, 6], [1, 2]) == 0.0 and rouge_l([], [1]) == 0.0 and rouge_l([1], []) == 0.0


@pytest.fixture(scope="module")
def model():
    return make_model("qwen2", num_hidden_layers=2, vocab_size=300, seed=5).eval()


def reference(model, ids: list[int], tokens: int) -> list[int]:
    """The gist's reference answer: kvhub.eval.gist.own_answer, transformers' greedy generate from a full prefill
    with end of sequence suppressed (min_new_tokens)."""
    return own_answer(model, ids, answer_tokens=tokens)


def test_each_row_is_what_generate_writes_whatever_the_other_rows(model):
    rng = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (n,), generator=rng).tolist() for n in (40, 17, 29)]
    prompts = [p[:-1] + [prompts[0][-1]] for p in prompts]  # one last token for every row, as the gist has
    caches = [run_model(model, torch.tensor([p[:-1]])) for p in prompts]
    before = [copy.deepcopy(c.layers[0].keys) for c in caches]
    batched = greedy_rows(model, [Row(c) for c in caches], prompts[0][-1], 12)
    for prompt, written in zip(prompts, batched):
        assert written == reference(model, prompt, 12)
    assert all(torch.equal(c.layers[0].keys, b) for c, b in zip(caches, before))  # the caches are only read
    alone = greedy_rows(model, [Row(caches[1])], prompts[0][-1], 12)
    assert alone[0] == batched[1]


def stepwise(model, cache, start: int, first: int, tokens: int) -> list[int]:
    """Greedy decoding the plain way: the whole tail so far forwarded over a fresh copy of ``cache`` at positions
    from ``start``, no mask given (transformers' own causal mask over the entries), end of sequence suppressed."""
    tail, suppressed = [first], sorted(eos_ids(model))
    for _ in range(tokens):
        positions = torch.arange(start, start + len(tail))[None]
        logits = model(
            input_ids=torch.tensor([tail]), position_ids=positions, **cache_kwargs(model, copy.deepcopy(cache))
        ).logits[0, -1]
        logits[suppressed] = float("-inf")
        tail.append(int(logits.argmax()))
    return tail[1:]


def test_a_drop_cache_continues_at_its_true_position(model):
    """A drop cache (fewer entries than positions) continues at the position it is given, padded in a batch
    beside a longer cache: each row is what plain decoding over that cache at those positions writes."""
    ids = torch.randint(3, 300, (1, 33), generator=torch.Generator().manual_seed(1))
    context, first = ids[:, :-1], int(ids[0, -1])
    full = drop_cache(model, context, torch.arange(32))
    sparse = drop_cache(model, context, torch.tensor([0, 1, 2, 30, 31]))
    at_true, at_length, whole = greedy_rows(model, [Row(sparse, start=32), Row(sparse), Row(full, start=32)], first, 8)
    assert at_true == stepwise(model, sparse, 32, first, 8)
    assert at_length == stepwise(model, sparse, 5, first, 8)
    assert whole == reference(model, ids[0].tolist(), 8)
    assert at_true != at_length  # the position is what differs between the two


def test_end_of_sequence_is_suppressed_as_the_reference_does(model):
    """With the token greedy writes first made the end of sequence, it is never written, and the rest is what
    generate(min_new_tokens=n) writes."""
    rng = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, 300, (20,), generator=rng).tolist()
    cache = run_model(model, torch.tensor([prompt[:-1]]))
    free = greedy_rows(model, [Row(cache)], prompt[-1], 16)[0]
    stopping = copy.deepcopy(model)
    stopping.config.eos_token_id = stopping.generation_config.eos_token_id = free[0]
    assert eos_ids(stopping) == {free[0]}
    written = greedy_rows(stopping, [Row(cache)], prompt[-1], 16)[0]
    assert free[0] not in written and written == reference(stopping, prompt, 16)


def test_an_empty_cache_continues_from_nothing_beside_full_ones(model):
    """A drop cache of no position (a handoff that recomputed nothing): the row sees only its own tokens."""
    ids = torch.randint(3, 300, (1, 21), generator=torch.Generator().manual_seed(3))
    empty = drop_cache(model, ids[:, :-1], torch.empty(0, dtype=torch.long))
    full = run_model(model, ids[:, :-1])
    nothing, whole = greedy_rows(model, [Row(empty, start=20), Row(full)], int(ids[0, -1]), 6)
    assert nothing == stepwise(model, empty, 20, int(ids[0, -1]), 6)
    assert whole == reference(model, ids[0].tolist(), 6)
    assert greedy_rows(model, [Row(empty, start=20)], int(ids[0, -1]), 6)[0] == nothing
