"""Paired differences between recompute variants, item by item, from `kvhub eval --log-samples` files.

Two variants scored on the same items differ by less than either interval suggests: the items are the
same, so the difference is bootstrapped over items (each resample takes the same items for both).
Reads the samples files that ``kvhub eval ... --log-samples --output-path DIR`` writes (one JSON line
per item and variant, kvhub.eval.results) and prints, per task, every variant against the first one
(or ``--baseline``): mapped accuracy (and acc_norm for multiple choice) of each, their paired
difference and its 95% interval (2,000 resamples).

    kvhub eval REF --task hellaswag --limit 300 --exact-prefix 4 --exact-suffix 16 --exact-budget 0 \
        --exact-budget 0.08 --select source --log-samples --output-path out/
    python benchmarks/paired_variants.py out/*/samples_hellaswag_*.jsonl
"""

from __future__ import annotations

import json
import random
from collections import defaultdict

import click


def paired(a: list[float], b: list[float], *, resamples: int = 2000, seed: int = 0) -> tuple[float, list[float]]:
    """(mean of b - a, 95% bootstrap interval) over paired items."""
    n = len(a)
    rng = random.Random(seed)
    diffs = [y - x for x, y in zip(a, b)]
    boot = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    return sum(diffs) / n, [boot[int(0.025 * resamples)], boot[int(0.975 * resamples) - 1]]


@click.command()
@click.argument("samples", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--baseline", default=None, help="Variant name to compare against (default: the first one).")
@click.option("--json", "as_json", is_flag=True)
def main(samples, baseline, as_json):
    by_task = defaultdict(lambda: defaultdict(dict))  # task -> variant -> doc_id -> record
    for path in samples:
        with open(path) as handle:
            for line in handle:
                record = json.loads(line)
                by_task[record["task"]][record["variant"]][str(record["doc_id"])] = record
    rows = []
    for task, variants in by_task.items():
        names = list(variants)
        base = baseline if baseline is not None else names[0]
        if base not in variants:
            raise click.UsageError(f"no variant {base!r} in {task}; have {', '.join(names)}")
        for name in names:
            if name == base:
                continue
            common = sorted(set(variants[base]) & set(variants[name]))
            row = {"task": task, "baseline": base, "variant": name, "n": len(common)}
            for metric in ("correct", "correct_norm"):
                if metric not in variants[base][common[0]]:
                    continue
                a = [float(variants[base][i][metric]["mapped"]) for i in common]
                b = [float(variants[name][i][metric]["mapped"]) for i in common]
                diff, interval = paired(a, b)
                row[metric] = {
                    "baseline": sum(a) / len(a),
                    "variant": sum(b) / len(b),
                    "difference": diff,
                    "ci95": interval,
                }
            rows.append(row)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for row in rows:
        for metric in ("correct", "correct_norm"):
            if metric in row:
                m = row[metric]
                click.echo(
                    f"{row['task']} {metric}: {row['variant']} {m['variant']:.3f} vs {row['baseline']} "
                    f"{m['baseline']:.3f}: {m['difference']:+.3f} [{m['ci95'][0]:+.3f}, {m['ci95'][1]:+.3f}] "
                    f"(n={row['n']})"
                )


if __name__ == "__main__":
    main()
