"""The gist (:mod:`kvhub.eval.gist`) scored on a running ``kvhub serve`` pair over HTTP.

Per item, one request at a time (the small server stores the prompt's KV before the large one looks):

=========  ======  ==========================  ====================================================
condition  server  cache_salt                  request
=========  ======  ==========================  ====================================================
(store)    small   the item's tenant           one token: the small model's KV of the prompt is stored
own        large   a fresh one                 the large model's greedy answer A (``answer_tokens``),
                                               from its own prefill, with its log-probabilities
mapped     large   the item's tenant           A forced, over the stored KV mapped (the escalation)
control    large   the item's tenant, with     A forced, over the no-information control map
                   ``kvhub_control``
floor      large   a fresh one                 A forced after the last ``FLOOR_TOKENS`` prompt tokens
(written)  large   as mapped, control, floor   the large model's greedy answer (``len(A)`` tokens) under
                                               each of the three, scored by ROUGE-L against A
=========  ======  ==========================  ====================================================

"A forced" is :mod:`kvhub.serving.forced`: the request's ``vllm_xargs`` names A's ids, the server's logits
processor lets only those be generated, and the log-probabilities vLLM returns are the model's own, taken
before the processor: the teacher-forced score of A, over whatever KV the connector loaded.  (vLLM's
``prompt_logprobs`` cannot do this: a request asking for them skips every cached prefix, the connector's
loads included, so "mapped" would silently be own.)  A server that did not generate A under force was
not started by ``kvhub serve``: a ServeError says so.

Scores are :class:`~kvhub.eval.gist.GistScore` (mean NLL per answer token under each condition) and the
summary is :func:`~kvhub.eval.gist.summarize_gist`'s (gap closed by mapped and by control, with intervals),
plus ``recomputed_fraction``: the connector's ``exact_tokens`` over the prompt's n - 1 context positions.
"""

from __future__ import annotations

from kvhub.errors import ServeError
from kvhub.eval.generation import rouge_l
from kvhub.eval.gist import (
    ANSWER_TOKENS,
    FLOOR_TOKENS,
    GistItem,
    GistScore,
    gap_closed,
    gen_gap_closed,
    summarize_gist,
)
from kvhub.eval.served import CONTROL_PARAMS, Completion, Endpoint, new_tenant, reported_deshrink
from kvhub.serving.launch import FORCE_KEY, FORCED_PROCESSOR


def mean_nll(completion: Completion) -> float:
    return -sum(completion.logprobs) / len(completion.logprobs)


def forced(
    endpoint: Endpoint,
    prompt_ids: list[int],
    answer: list[int],
    *,
    cache_salt: str,
    kv_transfer_params: dict | None = None,
) -> Completion:
    """``answer`` generated under force after ``prompt_ids``, with its log-probabilities; ServeError when the
    server generated other ids (no kvhub logits processor: not started by ``kvhub serve``)."""
    completion = endpoint.complete(
        prompt_ids,
        max_tokens=len(answer),
        cache_salt=cache_salt,
        logprobs=True,
        kv_transfer_params=kv_transfer_params,
        vllm_xargs={FORCE_KEY: list(answer)},
    )
    if completion.token_ids != list(answer) or len(completion.logprobs) != len(answer):
        raise ServeError(
            f"{endpoint.url} did not generate the answer it was asked to score (vllm_xargs.{FORCE_KEY}): "
            "its vLLM runs without kvhub's logits processor; start the pair with `kvhub serve`, or "
            f"add --logits-processors {FORCED_PROCESSOR} to the large server's `vllm serve`"
        )
    return completion


def score_served_gist_item(
    item: GistItem, *, small: Endpoint, large: Endpoint, answer_tokens: int = ANSWER_TOKENS
) -> GistScore:
    """``item`` under the conditions of the module docstring, one request at a time."""
    prompt = item.prompt_ids
    tenant = new_tenant()
    small.complete(prompt, max_tokens=1, cache_salt=tenant)
    own = large.complete(prompt, max_tokens=answer_tokens, cache_salt=new_tenant(), logprobs=True)
    answer = own.token_ids
    if not answer or len(own.logprobs) != len(answer):
        raise ServeError(f"{large.url} answered {item.id} without token ids and their logprobs")
    mapped = forced(large, prompt, answer, cache_salt=tenant)
    control = forced(large, prompt, answer, cache_salt=tenant, kv_transfer_params=dict(CONTROL_PARAMS))
    floor = forced(large, prompt[-FLOOR_TOKENS:], answer, cache_salt=new_tenant())
    nll = {"own": mean_nll(own), "mapped": mean_nll(mapped), "control": mean_nll(control), "floor": mean_nll(floor)}
    # by generation: what the large model writes under each (own's is the answer itself, written the same way)
    written = {
        "mapped": large.complete(prompt, max_tokens=len(answer), cache_salt=tenant),
        "control": large.complete(
            prompt, max_tokens=len(answer), cache_salt=tenant, kv_transfer_params=dict(CONTROL_PARAMS)
        ),
        "floor": large.complete(prompt[-FLOOR_TOKENS:], max_tokens=len(answer), cache_salt=new_tenant()),
    }
    rouge = {"own": rouge_l(answer, answer), **{c: rouge_l(w.token_ids, answer) for c, w in written.items()}}
    exact = mapped.recomputed_tokens
    return GistScore(
        item.id,
        nll,
        answer,
        {
            **item.meta,
            "variant": "served",
            "exact_tokens": exact,
            "context_positions": len(prompt) - 1,
            "deshrink": mapped.deshrink,
        },
        rouge=rouge,
    )


def served_gist_record(task: str, item: GistItem, score: GistScore) -> dict:
    """``--log-samples``' record of one item, as ``kvhub eval``'s gist records."""
    return {
        "task": task,
        "variant": "served",
        "doc_id": item.id,
        "nll": score.nll,
        "answer": score.answer,
        "gap_closed": {c: gap_closed(score.nll, c) for c in ("mapped", "control")},
        "rouge": score.rouge,
        "gen_gap_closed": {c: gen_gap_closed(score.rouge, c) for c in ("mapped", "control") if c in score.rouge},
        "meta": score.meta,
    }


def summarize_served_gist(scores: list[GistScore], *, seed: int = 0) -> dict:
    """:func:`~kvhub.eval.gist.summarize_gist` of the scores with ``recomputed_fraction`` (the mapped requests'
    exact positions over their context positions, summed; NaN when no transfer was reported),
    ``transfers_reported`` and ``deshrink`` (:func:`~kvhub.eval.served.reported_deshrink`)."""
    summary = summarize_gist(scores, seed=seed)
    reported = [s.meta for s in scores if s.meta["exact_tokens"] is not None]
    summary["recomputed_fraction"] = (
        sum(m["exact_tokens"] for m in reported) / sum(m["context_positions"] for m in reported)
        if reported
        else float("nan")
    )
    summary.update(transfers_reported=len(reported), deshrink=reported_deshrink(s.meta["deshrink"] for s in scores))
    return summary
