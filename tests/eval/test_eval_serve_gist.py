"""The gist over HTTP (kvhub.eval.served_gist) against test_eval_serve's stand-in for `kvhub serve`.

The stand-in's large server maps with an exact map and forces ``vllm_xargs.kvhub_force`` as kvhub serve's
logits processor does, so every condition has a known answer computed here from the models directly:
mapped scores exactly as own (gap closed 1), control as the damaged model, floor as the large model after
the last 32 prompt tokens.
"""

from __future__ import annotations

import json

import pytest

from kvhub.errors import ServeError
from kvhub.eval import served
from kvhub.eval.generation import rouge_l
from kvhub.eval.gist import ANSWER_TOKENS, FLOOR_TOKENS, GistItem
from kvhub.eval.served import Endpoint
from kvhub.eval.gist import GistTask
from kvhub.eval.served_conditions import ServedConditions, run_served
from tests.eval.test_eval_serve import (  # noqa: F401  (pytest fixtures, shared with the facts tests)
    EXACT_TAIL,
    LARGE_NAME,
    PROMPTS,
    _invoke,
    decode,
    models,
    module_pair,
    pair,
    tokenizer,
    tokenizer_dir,
)

ANSWER = 6  # answer tokens: fewer than the default 48, a tiny model's decode per request


@pytest.fixture(scope="module")
def items(tokenizer):
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in PROMPTS]
    assert all(len(p) > FLOOR_TOKENS for p in prompts)
    return [GistItem(f"hand-{i}", p, {"context_tokens": len(p)}) for i, p in enumerate(prompts)]


def _evaluate(pair, items, **options) -> dict:
    small, large = Endpoint(pair.small_url, pair.small_name), Endpoint(pair.large_url, LARGE_NAME)
    conditions = ServedConditions(small, large, None, answer_tokens=ANSWER)
    return run_served(GistTask("gist-hand", conditions, context_tokens=64, limit=len(items), items=items), **options)


def _nll(logprobs: list[float]) -> float:
    return -sum(logprobs) / len(logprobs)


def test_each_condition_scores_the_own_answer_teacher_forced(pair, items, models):
    summary = _evaluate(pair, items, log_samples=True)
    for record, item in zip(summary["samples"], items):
        answer, own = decode(models["large"], item.prompt_ids, ANSWER)
        assert record["answer"] == answer
        expected = {
            "own": _nll(own),
            "mapped": _nll(own),
            "control": _nll(decode(models["control"], item.prompt_ids, ANSWER, answer)[1]),
            "floor": _nll(decode(models["large"], item.prompt_ids[-FLOOR_TOKENS:], ANSWER, answer)[1]),
        }
        assert record["nll"] == pytest.approx(expected, rel=1e-6)
        assert record["gap_closed"]["mapped"] == pytest.approx(1.0)
        # by generation: the exact map writes the own answer; control and floor what those models write greedily
        written = {
            "control": decode(models["control"], item.prompt_ids, ANSWER)[0],
            "floor": decode(models["large"], item.prompt_ids[-FLOOR_TOKENS:], ANSWER)[0],
        }
        assert record["rouge"] == pytest.approx(
            {"own": 1.0, "mapped": 1.0, **{c: rouge_l(w, answer) for c, w in written.items()}}
        )
        assert record["meta"]["exact_tokens"] == EXACT_TAIL
    # the damaged model knows nothing of the context: it closes less of the gap than the exact map
    assert summary["gap_closed_mapped"] == pytest.approx(1.0) and summary["gap_closed_control"] < 1
    assert summary["rouge_mapped"] == 1.0 and "gen_gap_closed_control" in summary
    assert summary["n"] == len(items) and summary["transfers_reported"] == len(items)
    assert summary["deshrink"] == "kv"  # as the large server reported it
    assert summary["recomputed_fraction"] == pytest.approx(
        EXACT_TAIL * len(items) / sum(len(item.prompt_ids) - 1 for item in items)
    )
    assert (summary["task"], summary["answer_tokens"]) == ("gist-hand", ANSWER)


def test_requests_go_one_at_a_time_store_own_mapped_control_floor(pair, items):
    _evaluate(pair, items[:2])
    requests = pair.requests
    assert len(requests) == 8 * 2
    for index, item in enumerate(items[:2]):
        store, own, mapped, control, floor, *written = requests[8 * index : 8 * index + 8]
        assert written[:2] == [mapped, control]  # the greedy answers, under the same KV as the forced ones
        assert written[2][0] == "large" and written[2][1] != floor[1] and written[2][3] == FLOOR_TOKENS
        tenant = store[1]
        assert store == ("small", tenant, False, len(item.prompt_ids)) and tenant.startswith(served.TENANT_PREFIX)
        assert own[0] == "large" and own[1] != tenant
        assert mapped == ("large", tenant, False, len(item.prompt_ids))
        assert control == ("large", tenant, True, len(item.prompt_ids))
        assert floor[0] == "large" and floor[1] not in (tenant, own[1]) and floor[3] == FLOOR_TOKENS


def test_a_server_that_does_not_force_is_refused_with_the_fix(pair, items):
    """Without kvhub's logits processor the server answers greedily, and the damaged control model's greedy
    answer is not the own answer: scored as if forced, its logprobs would be of other tokens."""
    pair.forcing = False
    try:
        with pytest.raises(ServeError, match="without kvhub's logits processor; start the pair with `kvhub serve`"):
            _evaluate(pair, items[:1])
    finally:
        pair.forcing = True


def test_the_command_scores_gist_code(pair, tmp_path):
    out = tmp_path / "results.json"
    result = _invoke(
        "--small",
        pair.small_url,
        "--large",
        pair.large_url,
        "--task",
        "gist-code",
        "--context-tokens",
        64,
        "--limit",
        1,
        "--json",
        "--output-path",
        out,
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)["results"]["gist-code-64"]
    assert summary["n"] == 1 and summary["answer_tokens"] == ANSWER_TOKENS
    assert summary["gap_closed_mapped"] == pytest.approx(1.0) and summary["nll_mapped"] == pytest.approx(
        summary["nll_own"]
    )
    table = _invoke(
        "--small",
        pair.small_url,
        "--large",
        pair.large_url,
        "--task",
        "gist-code",
        "--context-tokens",
        64,
        "--limit",
        1,
    )
    assert table.exit_code == 0, table.output
    assert "gap closed [95% CI]" in table.stdout and "gist-code-64" in table.stdout
