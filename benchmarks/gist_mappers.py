"""Two mappers on the same gist items, paired: the gap each closes (teacher-forced NLL and by generation), and
their difference with a 95% interval that resamples items (the same items for both).

A lever (a calibration size, a weighting, a map kind) is chosen on the gist suite's dev split and reported on its
test split (issue 47): score each mapper with ``kvhub eval REF --task gist-dev ... --log-samples --output-path
DIR`` on the same items, then

    python benchmarks/gist_mappers.py /tmp/dev_v1 /tmp/dev_v2 --names uniform,attention --out lever.json

Reads every ``samples_gist*.jsonl`` under each directory (one JSON line per item and variant, kvhub.eval.results),
pairs the records by (task, variant, item), and prints per task and variant: each mapper's gap closed by mapped
(the ratio of the mean NLLs over the items; by generation the ratio of the mean ROUGE-L), each one's mapped -
best control, and B - A with its interval (:func:`kvhub.eval.bootstrap.with_intervals`, 1,000 resamples).  Items only
one side scored are left out and counted.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from kvhub.eval.bootstrap import with_intervals
from kvhub.eval.gist import gap_closed, gen_gap_closed
from kvhub.eval.gist_controls import GIST_CONTROLS

MEASURES = {"nll": gap_closed, "rouge": gen_gap_closed}


def read_samples(directory: Path) -> dict:
    """(task, variant) -> item id -> record, from every gist samples file under ``directory``."""
    out: dict = defaultdict(dict)
    for path in sorted(directory.rglob("samples_gist*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                out[(record["task"], record["variant"])][record["doc_id"]] = record
    return out


def compare(a: dict, b: dict, *, seed: int = 0, resamples: int = 1000) -> dict:
    """Per ``task@variant`` both sides scored: n, left_out, and per measure (nll, rouge) each side's gap closed,
    mapped - best control, and ``difference`` (B - A) with ``difference_ci``."""
    out = {}
    for key in sorted(set(a) & set(b)):
        ids = sorted(set(a[key]) & set(b[key]))
        if not ids:
            continue
        pairs = [(a[key][i], b[key][i]) for i in ids]
        row = {"n": len(ids), "left_out": len(set(a[key]) ^ set(b[key]))}
        for measure, closed in MEASURES.items():
            if not all(measure in r and "mapped" in r[measure] for pair in pairs for r in pair):
                continue

            def stats(index, pairs=pairs, measure=measure, closed=closed) -> dict:
                point = {}
                for side, name in ((0, "a"), (1, "b")):
                    records = [pairs[i][side][measure] for i in index]
                    present = [c for c in records[0] if all(c in r for r in records)]
                    mean = {c: sum(r[c] for r in records) / len(records) for c in present}
                    point[name] = closed(mean, "mapped")
                    controls = [closed(mean, c) for c in ("control", *GIST_CONTROLS) if c in mean]
                    point[f"{name}_minus_best_control"] = point[name] - max(controls) if controls else float("nan")
                point["difference"] = point["b"] - point["a"]
                return point

            row[measure] = with_intervals(stats, len(ids), seed=seed, resamples=resamples)
        task, variant = key
        out[f"{task}@{variant or 'map alone'}"] = row
    return out


def table(result: dict, names: tuple[str, str]) -> str:
    a, b = names
    lines = [
        f"| task@variant | n | measure | {a} | {b} | {b} - {a} [95% CI] | {a} - best control | {b} - best control |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key, row in result.items():
        for measure in MEASURES:
            if measure not in row:
                continue
            m = row[measure]
            low, high = m["difference_ci"]
            lines.append(
                f"| {key} | {row['n']} | {'NLL' if measure == 'nll' else 'generation'} | {m['a']:.2f} | {m['b']:.2f} "
                f"| {m['difference']:+.2f} [{low:+.2f}, {high:+.2f}] | {m['a_minus_best_control']:+.2f} "
                f"| {m['b_minus_best_control']:+.2f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", type=Path, help="the --output-path of the first mapper's kvhub eval --log-samples")
    parser.add_argument("b", type=Path, help="the same for the second mapper")
    parser.add_argument("--names", default="A,B", help="the two mappers' names in the table")
    parser.add_argument("--out", type=Path, default=None, help="write the comparison as JSON here too")
    args = parser.parse_args(argv)
    names = tuple(args.names.split(",", 1)) if "," in args.names else ("A", "B")
    result = compare(read_samples(args.a), read_samples(args.b))
    if not result:
        raise SystemExit(f"no gist item scored on both sides under {args.a} and {args.b}")
    print(table(result, names), end="")
    if args.out:
        args.out.write_text(json.dumps({"names": names, "a": str(args.a), "b": str(args.b), **result}, indent=1) + "\n")


if __name__ == "__main__":
    main()
