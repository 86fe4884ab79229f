"""The result tables of ``kvhub eval``, ``kvhub bench`` and ``kvhub eval-serve``: one row per task (and length,
and variant), numbers shown the one way :func:`kvhub.cli.output.format_number` shows them."""

from __future__ import annotations

import math

from kvhub.cli.console import plain
from kvhub.cli.output import format_number, print_table

SERVED_COLUMNS = (
    "task",
    "n",
    "tokens",
    "recomputed %",
    "own",
    "mapped",
    "control",
    "source",
    "floor",
    "retention [95% CI]",
    "map - control [95% CI]",
    "median agreement mapped / control",
)


def number(value) -> str:
    """A result number the one way tables show numbers (kvhub.cli.output.format_number); NaN is an empty cell,
    as JSON's null."""
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else format_number(value)


def print_results(ref: str, results: dict, *, output_format: str = "table") -> None:
    """The tables of ``kvhub eval``: accuracy tasks, perplexity, exact-answer tasks and the gist, each its own."""
    recall = {task: r for task, r in results.items() if "acc_control" in r}
    gist = {task: r for task, r in results.items() if "gap_closed_mapped" in r}
    perplexity = {task: r for task, r in results.items() if task.startswith("ppl") and task not in recall | gist}
    rows = []
    for task, r in results.items():
        if task in recall or task in gist or task in perplexity:
            continue
        low, high = r["retention_ci"]
        rows.append(
            [
                task,
                r["n"],
                number(r["acc_own"]),
                number(r["acc_mapped"]),
                number(r["acc_source"]),
                f"{number(r['retention'])} [{number(low)}, {number(high)}]",
                number(r["gap_closed"]),
                number(r["agree_next"]),
                number(r["attn_cosine"]),
            ]
        )
    columns = ["task", "n", "own", "mapped", "source", "retention [95% CI]", "gap closed", "agree", "attn cos"]
    if rows:
        print_table(columns, rows, output_format=output_format, title=ref, right=tuple(columns[1:]))
    if perplexity:
        print_perplexity(ref, perplexity, output_format=output_format)
    groups: dict[tuple, dict] = {}  # one table per set of conditions (the follow-up turn has more)
    for task, r in recall.items():
        groups.setdefault(tuple(key for key in r if key.startswith("acc_")), {})[task] = r
    for group in groups.values():
        print_recall(ref, group, output_format=output_format)
    if gist:
        print_gist(ref, gist, output_format=output_format)


def print_perplexity(ref: str, results: dict, *, output_format: str) -> None:
    """Perplexity of the held-out continuation per condition (lower is better): the target's own cache, the
    mapped one, ``drop`` (only the recomputed positions, where the run scored it) and no context at all."""
    columns = ["task", "n", "own ppl", "mapped ppl", "drop ppl", "no context ppl", "agree"]
    rows = [
        [
            task,
            r["n"],
            number(r["ppl_own"]),
            number(r["ppl_mapped"]),
            number(r.get("ppl_drop")),
            number(r["ppl_no_context"]),
            number(r["agreement"]),
        ]
        for task, r in results.items()
    ]
    title = f"{ref}: perplexity of the continuation (lower is better)"
    print_table(columns, rows, output_format=output_format, title=title, right=tuple(columns[1:]))


GIST_ORDER = ("own", "mapped", "drop", "control", "wrong", "zero", "raw", "floor")  # a gist table's columns


def print_gist(ref: str, results: dict, *, output_format: str) -> None:
    """The gist results tables (also kvhub eval-serve's): mean NLL per condition and the gap closed (``drop``,
    the target prefilling only the recomputed tokens, and the ``wrong`` / ``zero`` controls, where the run scored
    them; mapped - the best control, where there are several: a result counts only where that is above 0); the
    same by generation where it was scored, and by the judge where it judged; the keyed answers where items have
    them."""
    results = with_domains(results)
    title = f"{ref}: the target's own answer about the whole context, mean NLL per token"
    gist_table(results, "nll", "gap_closed", title=title, output_format=output_format)
    generated = {task: r for task, r in results.items() if "gen_gap_closed_mapped" in r}
    if generated:
        title = f"{ref}: the target's greedy answer under each cache against its own, ROUGE-L (higher is better)"
        gist_table(generated, "rouge", "gen_gap_closed", title=title, output_format=output_format)
    judged = {task: r for task, r in results.items() if "judge_gap_closed_mapped" in r}
    if judged:
        title = f"{ref}: does the answer under each cache say what the target's own says? The judge's P(yes)"
        gist_table(judged, "judged", "judge_gap_closed", title=title, output_format=output_format)
    keyed = {task: r for task, r in results.items() if r.get("key_n")}
    if keyed:
        print_keyed(ref, keyed, output_format=output_format)


def gist_table(results: dict, measure: str, prefix: str, *, title: str, output_format: str) -> None:
    """One gist table: ``<measure>_<condition>`` of every condition every row has, then ``<prefix>_<condition>``
    (the gap closed) of each but own and floor, and ``<prefix>_map_minus_controls`` where every row has it."""
    conditions = [c for c in GIST_ORDER if all(f"{measure}_{c}" in r for r in results.values())]
    closing = [c for c in conditions if c not in ("own", "floor")]
    every = all(f"{prefix}_map_minus_controls" in r for r in results.values())
    columns = [
        "task",
        "n",
        "tokens",
        *conditions,
        *("gap closed [95% CI]" if c == "mapped" else f"{c} closes [95% CI]" for c in closing),
        *(["mapped - best control [95% CI]"] if every else []),
    ]
    rows = []
    for task, r in results.items():
        closes = [closed(r, c, prefix) for c in closing] + ([closed(r, "map_minus_controls", prefix)] if every else [])
        values = (f"{r[f'{measure}_{c}']:.3f}" for c in conditions)
        rows.append([task, r["n"], f"{r['context_tokens']:.0f}", *values, *closes])
    print_table(columns, rows, output_format=output_format, right=tuple(columns[1:]), title=title)


def with_domains(results: dict) -> dict:
    """``results`` with each summary's ``domains`` (the gist suite) as rows of their own after it, named
    ``task:domain`` before the variant (``gist-1024:chat@...``)."""
    out = {}
    for task, r in results.items():
        out[task] = r
        name, at, variant = task.partition("@")
        for domain, inner in (r.get("domains") or {}).items():
            out[f"{name}:{domain}{at}{variant}"] = inner
    return out


def print_keyed(ref: str, results: dict, *, output_format: str) -> None:
    """The gist items with a keyed answer: the share whose key the target would write first, per condition."""
    first = next(iter(results.values()))
    conditions = [c for c in GIST_ORDER if f"key_{c}" in first]
    differences = [k for k in ("drop", "controls") if all(f"key_map_minus_{k}" in r for r in results.values())]
    columns = ["task", "keyed n", *conditions, *(f"mapped - {k} [95% CI]" for k in differences)]
    rows = []
    for task, r in results.items():
        cells = [f"{r.get(f'key_{c}', float('nan')):.2f}" for c in conditions]
        for k in differences:
            low, high = r[f"key_map_minus_{k}_ci"]
            cells.append(f"{r[f'key_map_minus_{k}']:+.2f} [{low:+.2f}, {high:+.2f}]")
        rows.append([task, r["key_n"], *cells])
    print_table(
        columns, rows, output_format=output_format, right=tuple(columns[1:]), title=f"{ref}: keyed answers (exact)"
    )


def closed(r: dict, name: str, prefix: str = "gap_closed") -> str:
    """``<prefix>_<name>`` (a condition, or a difference such as ``map_minus_controls``) with its interval."""
    low, high = r[f"{prefix}_{name}_ci"]
    return f"{r[f'{prefix}_{name}']:+.2f} [{low:+.2f}, {high:+.2f}]"


def print_recall(ref: str, results: dict, *, output_format: str) -> None:
    """Exact answers per condition present in every row (``drop``, the follow-up's re-selections), with
    retention and the map's paired differences from the control and from drop."""
    first = next(iter(results.values()))
    conditions = [
        c.removeprefix("acc_")
        for c in first
        if c.startswith("acc_") and not c.endswith("_ci") and all(c in r for r in results.values())
    ]
    differences = [
        key
        for key in ("map_minus_control", "map_minus_drop", "reselect_minus_drop", "reselect_minus_drop_reselect")
        if all(key in r for r in results.values())
    ]
    columns = [
        "task",
        "n",
        "tokens",
        "exact %",
        *conditions,
        "retention [95% CI]",
        *(f"{key.replace('_minus_', ' - ').replace('map ', 'mapped ')} [95% CI]" for key in differences),
    ]
    rows = []
    for task, r in results.items():
        low, high = r["retention_ci"]
        rows.append(
            [
                task,
                r["n"],
                f"{r['context_tokens']:.0f}",
                f"{100 * r['recomputed_fraction']:.1f}",
                *(f"{r[f'acc_{c}']:.2f}" for c in conditions),
                f"{r['retention']:.2f} [{low:.2f}, {high:.2f}]",
                *(f"{r[key]:+.2f} [{r[key + '_ci'][0]:+.2f}, {r[key + '_ci'][1]:+.2f}]" for key in differences),
            ]
        )
    print_table(
        columns,
        rows,
        output_format=output_format,
        right=tuple(columns[1:]),
        title=f"{ref}: exact answers from long contexts",
    )


# ---- kvhub eval-serve -----------------------------------------------------------------------------------
def print_served(title: str, results: dict, *, output_format: str = "table") -> None:
    rows = []
    for task, r in results.items():
        low, high = r["retention_ci"]
        dlow, dhigh = r["map_minus_control_ci"]
        rows.append(
            [
                task,
                r["n"],
                f"{r['context_tokens']:.0f}",
                f"{100 * r['recomputed_fraction']:.1f}",
                *(f"{r[f'acc_{c}']:.2f}" for c in ("own", "mapped", "control", "source", "floor")),
                f"{r['retention']:.2f} [{low:.2f}, {high:.2f}]",
                f"{r['map_minus_control']:+.2f} [{dlow:+.2f}, {dhigh:+.2f}]",
                f"{r['median_agreement_mapped']:g} / {r['median_agreement_control']:g} of {r['agreement_tokens']}",
            ]
        )
    print_table(
        list(SERVED_COLUMNS), rows, output_format=output_format, title=plain(title), right=SERVED_COLUMNS[1:]
    )  # model names: never markup


def print_turns(title: str, results: dict, output_format: str) -> None:
    from kvhub.eval.served_turns import TURN_ARMS

    columns = ["task", "arm", "n", "exact t1 / t2 / t3", "TTFT s t1 / t2 / t3", "own t1 / arm", "conversation s"]
    rows = []
    for task, r in results.items():
        for arm in TURN_ARMS:
            turns = range(1, r["turns"] + 1)
            rows.append(
                [
                    task,
                    arm,
                    r["n"],
                    " / ".join(f"{r[f'acc_{arm}_t{t}']:.2f}" for t in turns),
                    " / ".join(f"{r[f'ttft_{arm}_t{t}']:.2f}" for t in turns),
                    " / ".join(f"{r[f'speedup_{arm}_t{t}']:.1f}x" for t in turns),
                    f"{r[f'conversation_s_{arm}']:.2f}",
                ]
            )
    print_table(columns, rows, output_format=output_format, title=plain(title), right=columns[2:])
