"""One table from `kvhub eval --json` documents: own / map / default handoff / drop / control / floor per task.

The map column is the map-only variant (every context token mapped); handoff, drop and control come from
the `--variant handoff` run of the same items (drop keeps exactly the positions the handoff recomputed).
Long-context tasks report exact-match accuracy; the gist reports the gap closed (own = 1, floor = 0);
multiple choice reports accuracy (no floor: the source alone is shown instead).  The follow-up turn gives
two rows: the turn-1 cache as is, and with turn-2 re-selection (for drop: the newly chosen spans prefilled).

    kvhub eval REF --task facts --task followup ... --variant handoff --json > docs/results/drop_1k.json
    python benchmarks/drop_table.py docs/results/drop_1k.json [more.json[=LABEL] ...]

Several documents make one table, task by task (facts, RULER-style, follow-up, gist, multiple choice),
each row naming its map: LABEL, else the document's map kind (``config.map_kind``; documents older than
that field: "ridge") and calibration.
"""

from __future__ import annotations

import argparse
import json

HANDOFF = "exact_prefix=4,exact_suffix=16,exact_budget=0.08,select=source"


def _pair(results: dict, name: str) -> tuple[dict | None, dict | None]:
    """(map-only summary, handoff summary) of task ``name`` in one results block."""
    return results.get(name), results.get(f"{name}@{HANDOFF}")


def _ci(summary: dict, key: str) -> str:
    low, high = summary.get(f"{key}_ci", [float("nan")] * 2)
    return f"{summary[key]:+.2f} [{low:+.2f}, {high:+.2f}]"


ORDER = ("facts", "niah-multikey", "followup", "vt", "cwe", "gist-chat", "gist-document", "hellaswag")


def _order(name: str) -> tuple:
    """Sort key of a task name such as ``facts-1024``: the task's place in ORDER, then the context length."""
    stem, _, length = name.rpartition("-")
    if not length.isdigit():
        stem, length = name, "0"
    return (ORDER.index(stem) if stem in ORDER else len(ORDER), stem, int(length))


def label_of(document: dict) -> str:
    """``ridge mixed`` / ``mlp mixed``: the map kind and calibration of a kvhub eval document."""
    config = document.get("config", {})
    return f"{config.get('map_kind', 'ridge')} {config.get('calibration', '')}".strip()


def rows(results: dict) -> list[list[str]]:
    """Markdown cells per task found in ``results`` (a kvhub eval document's ``results``)."""
    names = sorted({key.split("@")[0] for key in results}, key=_order)
    out = []
    for name in names:
        plain, handoff = _pair(results, name)
        if handoff is None:
            continue
        n, share = handoff["n"], f"{100 * handoff.get('recomputed_fraction', float('nan')):.1f}"
        if "gap_closed_mapped" in handoff:  # the gist
            out.append(
                [
                    name,
                    n,
                    "1",
                    f"{plain['gap_closed_mapped']:.2f}" if plain else "",
                    f"{handoff['gap_closed_mapped']:.2f}",
                    f"{handoff['gap_closed_drop']:.2f}",
                    f"{handoff['gap_closed_control']:.2f}",
                    "0",
                    _ci(handoff, "gap_closed_map_minus_drop"),
                    "gap closed",
                ]
            )
        elif "acc_reselect" in handoff:  # the follow-up turn
            common = [f"{handoff['acc_own']:.2f}", f"{plain['acc_mapped']:.2f}" if plain else ""]
            out.append(
                [
                    f"{name}, turn 2 as turn 1 left it",
                    n,
                    *common,
                    f"{handoff['acc_mapped']:.2f}",
                    f"{handoff['acc_drop']:.2f}",
                    "",
                    f"{handoff['acc_floor']:.2f}",
                    _ci(handoff, "map_minus_drop"),
                    share,
                ]
            )
            out.append(
                [
                    f"{name}, re-selected at turn 2",
                    n,
                    *common,
                    f"{handoff['acc_reselect']:.2f}",
                    f"{handoff['acc_drop_reselect']:.2f}",
                    f"{handoff['acc_control']:.2f}",
                    f"{handoff['acc_floor']:.2f}",
                    _ci(handoff, "reselect_minus_drop_reselect"),
                    f"{share} + up to 8",
                ]
            )
        elif "acc_control" in handoff:  # facts, RULER-style
            out.append(
                [
                    name,
                    n,
                    f"{handoff['acc_own']:.2f}",
                    f"{plain['acc_mapped']:.2f}" if plain else "",
                    f"{handoff['acc_mapped']:.2f}",
                    f"{handoff['acc_drop']:.2f}",
                    f"{handoff['acc_control']:.2f}",
                    f"{handoff['acc_floor']:.2f}",
                    _ci(handoff, "map_minus_drop"),
                    share,
                ]
            )
        elif "acc_drop" in handoff:  # multiple choice
            out.append(
                [
                    name,
                    n,
                    f"{handoff['acc_own']:.3f}",
                    f"{plain['acc_mapped']:.3f}" if plain else "",
                    f"{handoff['acc_mapped']:.3f}",
                    f"{handoff['acc_drop']:.3f}",
                    "",
                    f"(source {handoff['acc_source']:.3f})",
                    _ci(handoff, "map_minus_drop"),
                    "accuracy",
                ]
            )
    return out


def table(documents: list[tuple[str, dict]]) -> list[str]:
    """Markdown lines of one table over (label, document) pairs, task by task, the documents' rows of a
    task together in the order given."""
    found = [
        (_order(cells[0].split(",")[0]), index, label, cells)
        for index, (label, document) in enumerate(documents)
        for cells in rows(document["results"])
    ]
    lines = [
        "| task | map | n | own | map alone | default handoff | drop | control | floor | handoff - drop [95% CI] "
        "| recomputed % |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for _, _, label, cells in sorted(found, key=lambda row: (row[0], row[1])):
        lines.append("| " + " | ".join(str(c) for c in [cells[0], label, *cells[1:]]) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("documents", nargs="+", help="kvhub eval --json documents, each PATH or PATH=LABEL")
    args = parser.parse_args()
    documents = []
    for spec in args.documents:
        path, _, label = spec.partition("=")
        with open(path) as handle:
            document = json.load(handle)
        documents.append((label or label_of(document), document))
    print("\n".join(table(documents)))


if __name__ == "__main__":
    main()
