"""Does the selective recompute choose the fact?  Selection coverage of the attention selectors (issue 10).

For each long-context item (kvhub.eval.longctx: passkey facts, multi-turn chats) the answer is stated
once in the context.  An item is *covered* by a selection when every token of that statement of the
answer lies inside the spans the selector chooses; a miss means the recompute cannot restore the fact
(docs/benchmarks.md, section 4: retrieval follows coverage item by item).  Compared: the source's
and the target's attention (over the mapped cache), each reduced with ``score=max`` and ``score=sum``
(kvhub.serving.recompute), at several query counts and budgets, with the first 4 and last 16 context
tokens exact as in the default handoff; beside them the no-information control, random spans of the
same budget (what coverage the budget alone buys).  Only the scoring passes run (no recompute, no generation), so
this is quick: about 3 minutes per 30 items at 1k tokens on 2 CPU cores.

    python benchmarks/selection_coverage.py [REF] --task facts --limit 30 --context-tokens 1024 \
        --task multiturn --json > docs/results/selection_coverage.json
"""

from __future__ import annotations

import itertools
import json

import click
import torch

from kvhub.core.capture import run_model
from kvhub.serving.recompute import (
    SCORES,
    attention_scores,
    cropped,
    query_attention,
    select_spans,
    span_ids,
    token_texts,
)

PREFIX, SUFFIX = 4, 16  # the default handoff's exact prefix and suffix


def answer_start(prompt: list[int], answer: list[int]) -> int | None:
    """Where the context states the answer: the last occurrence of its tokens before the question."""
    for start in range(len(prompt) - len(answer), -1, -1):
        if prompt[start : start + len(answer)] == answer:
            return start
    return None


@click.command()
@click.argument("ref", default="Qwen2.5-Coder-0.5B-Instruct:Qwen2.5-Coder-1.5B-Instruct:legal-docs@latest")
@click.option("--task", "tasks", multiple=True, default=("facts", "multiturn"))
@click.option("--context-tokens", default=1024)
@click.option("--limit", default=30)
@click.option("--queries", "query_counts", default="4,16", help="Comma-separated query counts.")
@click.option("--budgets", default="0.05,0.08", help="Comma-separated selected fractions of the context.")
@click.option("--db", default=None)
@click.option("--json", "as_json", is_flag=True)
def main(ref, tasks, context_tokens, limit, query_counts, budgets, db, as_json):
    from kvhub.eval.recall_tasks import build_items
    from kvhub.eval.run import load_version
    from kvhub.store import open_store

    torch.manual_seed(0)
    with open_store(db, create=False) as store:
        loaded = load_version(store, ref, device="cpu", dtype="bfloat16")
    version, mapper, source, target, tokenizer = (
        loaded.version,
        loaded.mapper,
        loaded.source,
        loaded.target,
        loaded.tokenizer,
    )
    query_counts = [int(q) for q in query_counts.split(",")]
    budgets = [float(b) for b in budgets.split(",")]
    rows = []
    for task in tasks:
        items = build_items(task, tokenizer, context_tokens=context_tokens, n=limit, seed=0)
        covered = {key: 0 for key in itertools.product(("source", "target"), SCORES, query_counts, budgets)}
        covered.update({("random", "-", 0, budget): 0 for budget in budgets})
        counted = 0
        for item in items:
            prompt = item.prompt_ids[:-1]
            start = answer_start(prompt[: len(prompt) - SUFFIX], item.answer_ids)
            if start is None:  # the answer is not stated as these tokens: nothing to cover
                continue
            counted += 1
            context = torch.tensor([prompt])
            tokens = context.shape[1]
            source_cache = run_model(source, context)
            mapped = mapper.transfer(source_cache, dtype=target.dtype)
            spans = span_ids(token_texts(tokenizer, context[0]), max_span=48)
            eligible = torch.ones(tokens, dtype=torch.bool)
            eligible[:PREFIX] = eligible[tokens - SUFFIX :] = False
            needed = torch.arange(start, start + len(item.answer_ids))
            draw = torch.rand(tokens, generator=torch.Generator().manual_seed(counted))  # control: no signal
            for budget in budgets:
                chosen = select_spans(draw, spans, round(budget * tokens), eligible=eligible)
                covered[("random", "-", 0, budget)] += bool(torch.isin(needed, chosen).all())
            for who, queries in itertools.product(("source", "target"), query_counts):
                model, cache = (source, source_cache) if who == "source" else (target, mapped)
                attention = query_attention(model, context, cropped(cache, tokens - queries), queries=queries)
                for score, budget in itertools.product(SCORES, budgets):
                    scores = attention_scores(attention, eligible, score=score)
                    chosen = select_spans(scores, spans, round(budget * tokens), eligible=eligible)
                    covered[(who, score, queries, budget)] += bool(torch.isin(needed, chosen).all())
        for (who, score, queries, budget), hits in covered.items():
            rows.append(
                {
                    "task": task,
                    "context_tokens": context_tokens,
                    "select": who,
                    "score": score,
                    "queries": queries,
                    "budget": budget,
                    "covered": hits,
                    "items": counted,
                }
            )
    if as_json:
        click.echo(json.dumps({"ref": ref, "tensors_sha256": version.tensors_sha256, "rows": rows}, indent=2))
    else:
        for row in rows:
            click.echo(
                f"{row['task']:<10} {row['select']:<7} score={row['score']:<4} queries={row['queries']:<3} "
                f"budget={row['budget']:<5} covered {row['covered']}/{row['items']}"
            )


if __name__ == "__main__":
    main()
