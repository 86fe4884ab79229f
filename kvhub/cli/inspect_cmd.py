"""Store commands that read: list, show, diff (kvhub.cli.store_cmd attaches them with the commands that
change the store).  Their JSON is the store commands' shared vocabulary (kvhub.cli.store_cmd's docstring).
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta

import click

from kvhub.artifact.metadata import shown
from kvhub.cli.console import say
from kvhub.cli.options import REF_HELP, db_option, open_db
from kvhub.cli.output import echo_json, format_number, format_option, format_size, print_table, version_json


def _lambda(value, output_format: str = "table"):
    """lambda as a cell: "auto" (None), else the number as the output format writes numbers."""
    return shown(value) if value is None else _number(value, output_format)


def _when(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%d %H:%M")


def _number(value, output_format: str = "table") -> str:
    return format_number(value, exact=output_format == "tsv")


# ---- list / show ---------------------------------------------------------------------------------
_HEADLINE = ("heldout_r2_k_mean", "heldout_r2_v_mean")


def _parse_thresholds(pairs: tuple[str, ...]) -> dict[str, float]:
    from kvhub.errors import ConfigError

    import math

    thresholds = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not name.strip() or not math.isfinite(number):
            raise ConfigError(
                f"--min-metric {pair!r}: write NAME=VALUE or NAME@TASK=VALUE with a finite number, "
                "e.g. heldout_r2_k_mean=0.9 or retention@hellaswag=0.9"
            )
        thresholds[name.strip()] = number
    return thresholds


@click.command("list")
@click.option("--src", default=None, help="Source model: full id or short name.")
@click.option("--dst", default=None, help="Target model: full id or short name.")
@click.option("--calib", default=None, help="Calibration-set name.")
@click.option("--family", default=None, help="Model family of the source (qwen2, llama, ...).")
@click.option(
    "--min-metric",
    "min_metrics",
    multiple=True,
    metavar="NAME[@TASK]=VALUE",
    help="Keep versions with a measurement NAME >= VALUE, on TASK only when given "
    "(retention@hellaswag=0.9; repeatable).",
)
@db_option
@format_option
def list_versions(src, dst, calib, family, min_metrics, db, output_format):
    """List mapper versions in the store, oldest first within each model pair.

    \b
    kvhub list
    kvhub list --src qwen2.5-coder-0.5b-instruct --min-metric heldout_r2_k_mean=0.9 --json
    kvhub list --min-metric retention@hellaswag=0.9
    kvhub list --format tsv | cut -f1

    The table's REF column holds short references where they are unambiguous; --format json and tsv
    always give full ones.  TEXT is the start of the calibration text's sha256 (one text per series).
    JSON: one object per version with its whole-mapper metrics.  Before the first fit (no store at
    the default location yet) the listing is empty.
    """
    filters = {"source": src, "target": dst, "calibration": calib, "family": family}
    thresholds = _parse_thresholds(min_metrics)
    versions, metrics = _listed(db, **filters, min_metrics=thresholds)
    if output_format == "json":
        echo_json([version_json(v, metrics.get(v.id, [])) for v in versions])
        return
    if not versions and output_format == "table":
        say(_no_match(db, filters, thresholds))
        return
    short_names = {v.short_ref for v in versions}
    short = output_format == "table" and len(short_names) == len({v.ref for v in versions})
    rows = []
    for v in versions:
        headline = {m["name"]: m["value"] for m in metrics.get(v.id, []) if m["task"] is None}
        text = v.calibration_text_sha256 or ""
        rows.append(
            [
                v.short_ref if short else v.ref,
                ",".join(v.aliases),
                _when(v.created_at),
                shown(v.k),
                _lambda(v.ridge_lambda, output_format),
                _number(headline.get(_HEADLINE[0]), output_format),
                _number(headline.get(_HEADLINE[1]), output_format),
                text[:12] if output_format == "table" else text,
                format_size(v.artifact_bytes) if output_format == "table" else v.artifact_bytes,
            ]
        )
    columns = [
        "REF",
        "ALIASES",
        "CREATED",
        "K",
        "LAMBDA",
        "R2 K",
        "R2 V",
        "TEXT",
        "SIZE" if output_format == "table" else "BYTES",
    ]
    print_table(columns, rows, output_format=output_format, right=("K", "LAMBDA", "R2 K", "R2 V", "SIZE"))


def _listed(db, **filters) -> tuple[list, dict]:
    """(versions matching ``filters``, their whole-mapper metrics); nothing when the default store was
    never created (a fresh install), while a --db or KVHUB_DB_URL naming no store stays a NotFoundError."""
    import os

    from kvhub.errors import NotFoundError

    try:
        store = open_db(db, create=False)
    except NotFoundError:
        if db is not None or os.environ.get("KVHUB_DB_URL"):
            raise
        return [], {}
    with store:
        versions = store.versions(**filters)
        return versions, store.mapper_metrics(versions)


_FILTER_OPTIONS = {"source": "--src", "target": "--dst", "calibration": "--calib", "family": "--family"}


def _no_match(db, filters: dict, thresholds: dict[str, float]) -> str:
    """Why a listing is empty: the thresholds no version kept by the other filters reaches, the filters
    no version in the store matches, or an empty store (first-run advice)."""
    candidates = len(_listed(db, **filters)[0])
    if thresholds and candidates:
        wanted = " and ".join(f"{name} >= {value:g}" for name, value in thresholds.items())
        return f"none of the {candidates} version{'s' if candidates > 1 else ''} has {wanted}"
    total = len(_listed(db)[0])
    if not total:
        return "no mapper versions yet; fit one with `kvhub fit` or import one with `kvhub import DIR`"
    given = " ".join(f"{_FILTER_OPTIONS[key]} {value}" for key, value in filters.items() if value is not None)
    return f"none of the {total} version{'s' if total > 1 else ''} in the store matches {given}; `kvhub list` shows all"


@click.command(epilog=REF_HELP)
@click.argument("ref")
@click.option(
    "--layers",
    "per_layer",
    is_flag=True,
    help="Also show every target layer: its source layers, lambdas, held-out R2 and per-layer metrics.",
)
@click.option("--verify", is_flag=True, help="Also hash every file of the artifact.")
@click.option(
    "--history",
    is_flag=True,
    help="Every measurement, oldest first, instead of the newest per metric, task (and variant), split and layer.",
)
@db_option
@format_option
def show(ref, per_layer, verify, history, db, output_format):
    """Show one mapper version: models, calibration set, fit, whole-mapper metrics, lineage, aliases
    and Hub publications (per-layer rows with --layers).

    \b
    kvhub show qwen2.5-coder-0.5b-instruct:qwen2.5-coder-1.5b-instruct:legal-docs@v3
    kvhub show ...@v3 --layers
    kvhub show ...@v3 --history         (every rerun of an evaluation, not just the newest)
    kvhub show ...@v3 --format tsv      (FIELD<TAB>VALUE lines; metrics as metric.NAME[.TASK][.layerN])

    A metric measured again (an evaluation rerun) shows its newest value; --history shows them all
    (in tsv with two more columns: each measurement's n and time).  JSON holds selected_layers and the per-layer metrics whatever --layers says.
    """
    with open_db(db, create=False) as store:
        data = store.describe(ref, history=history)
        if verify:
            store.verify(data["ref"])
    if output_format == "json":
        for key in ("k", "ridge_lambda"):
            data[key] = shown(data[key])
        data["lambda"] = data["ridge_lambda"]  # the knob's one JSON name; ridge_lambda kept for older scripts
        echo_json(data)
    else:
        _print_description(data, per_layer=per_layer, output_format=output_format, history=history)
    if verify:
        say("artifact verified: every file matches its recorded sha256 and the artifact format")


def _print_description(data: dict, *, per_layer: bool, output_format: str, history: bool = False) -> None:
    metrics = sorted(
        data["metrics"], key=lambda m: (m["layer"] is not None, m["name"], m["task"] or "", m["layer"] or 0)
    )
    shown = [m for m in metrics if per_layer or m["layer"] is None]
    if output_format == "tsv":  # FIELD<TAB>VALUE; --history adds each measurement's n and time (reruns apart)
        rows = [list(row) + (["", ""] if history else []) for row in _overview_rows(data)]
        rows += [
            [_metric_key(m), _number(m["value"], "tsv")]
            + (["" if m["n"] is None else m["n"], m["measured_at"]] if history else [])
            for m in shown
        ]
        print_table(["field", "value", "n", "measured"] if history else None, rows, output_format="tsv")
        return
    print_table(None, [list(row) for row in _overview_rows(data)])
    if per_layer:
        layer_rows = [
            [
                layer.get("target"),
                ",".join(map(str, layer.get("sources", []))),
                _number(layer.get("lambda_k")),
                _number(layer.get("lambda_v")),
                _number(layer.get("r2_k")),
                _number(layer.get("r2_v")),
            ]
            for layer in data["selected_layers"]
        ]
        click.echo()
        print_table(["TARGET", "SOURCES", "LAMBDA K", "LAMBDA V", "R2 K", "R2 V"], layer_rows, title="selected layers")
    click.echo()
    metric_rows = [
        [
            m["name"],
            _number(m["value"]) + (f" [{_number(ci[0])}, {_number(ci[1])}]" if ci else ""),
            m["split"] or "",
            m["task"] or "",
            "" if m["layer"] is None else m["layer"],
            "" if m["n"] is None else m["n"],
            m["measured_at"][:16],
        ]
        for m, ci in _with_intervals(shown)
    ]
    hidden = len(metrics) - len(shown)
    print_table(
        ["NAME", "VALUE", "SPLIT", "TASK", "LAYER", "N", "MEASURED"],
        metric_rows,
        title="metrics" + (f" ({hidden} per-layer values: --layers)" if hidden else ""),
    )


_SAME_EVALUATION = timedelta(seconds=1)  # one evaluation stores its rows at once; a rerun comes seconds later


def _with_intervals(metrics: list[dict]) -> list[tuple[dict, tuple[float, float] | None]]:
    """Each metric with its 95% interval (low, high) when both bounds were stored with it (``NAME_ci_low`` /
    ``NAME_ci_high`` of the same task, split, layer and n, in the same evaluation: kvhub.eval.run.metric_rows);
    the bounds so paired leave the list, others stay rows of their own."""

    def bound(metric: dict, suffix: str) -> dict | None:
        return next(
            (
                other
                for other in metrics
                if other["name"] == metric["name"] + suffix
                and all(other[key] == metric[key] for key in ("task", "split", "layer", "n"))
                and abs(_measured(other) - _measured(metric)) < _SAME_EVALUATION
            ),
            None,
        )

    paired, used = [], set()
    for metric in metrics:
        low, high = bound(metric, "_ci_low"), bound(metric, "_ci_high")
        if low is not None and high is not None:
            used |= {id(low), id(high)}
        paired.append((metric, (low["value"], high["value"]) if low and high else None))
    return [(metric, ci) for metric, ci in paired if id(metric) not in used]


def _measured(metric: dict) -> datetime:
    return datetime.fromisoformat(metric["measured_at"])


def _metric_key(metric: dict) -> str:
    """``metric.NAME[.TASK][.layerN]``: a TSV key unique per measurement kind."""
    parts = ["metric", metric["name"]] + ([metric["task"]] if metric["task"] else [])
    parts += [f"layer{metric['layer']}"] if metric["layer"] is not None else []
    return ".".join(parts)


def _overview_rows(data: dict) -> list[tuple[str, str]]:
    """show's key/value rows.  The calibration's hashes are labelled as everywhere: text (the sha256 of
    its documents, one per series: list's TEXT, fit's first line) and set (the built sequences)."""
    from kvhub.store.records import corpus_hash

    src, dst, calib = data["source_model"], data["target_model"], data["calibration_set"]
    geometry = "{num_layers} layers x {num_kv_heads} KV heads x {head_dim}"
    auto = data["k"] is None or data["ridge_lambda"] is None
    rows = [
        ("ref", data["ref"]),
        ("aliases", ", ".join(data["aliases"]) or "-"),
        ("created", data["created_at"]),
        ("source", f"{src['name']} @ {src['revision'] or '-'} ({src['model_type']}, {geometry.format(**src)})"),
        ("target", f"{dst['name']} @ {dst['revision'] or '-'} ({dst['model_type']}, {geometry.format(**dst)})"),
        (
            "calibration",
            f"{calib['name']} v{calib['version']} ({calib['tokens']} tokens, "
            f"text {corpus_hash(calib.get('recipe')) or '-':.12}, set {str(calib['content_hash']):.12})",
        ),
        (
            "k / lambda",
            f"{shown(data['k'])} / "
            f"{_lambda(data['ridge_lambda'])}" + (" (chosen per target layer: --layers)" if auto else ""),
        ),
        ("artifact", f"{data['artifact_path']} ({format_size(data['artifact_bytes'])})"),
        ("sha256", data["artifact_sha256"]),
        ("tensors sha256", data["tensors_sha256"]),
        ("written by", f"kvhub {data['kvhub_version']}, artifact format {data['format_version']}"),
        ("lineage", json.dumps(data["lineage"], sort_keys=True) if data["lineage"] else "-"),
    ]
    rows += [
        ("published", f"{p['repo_id']}@{p['revision']} (commit {str(p['commit_sha'])[:12]}, {p['published_at'][:16]})")
        for p in data["publications"]
    ]
    return rows


@click.command("diff", epilog=REF_HELP)
@click.argument("ref_a", metavar="REF1")
@click.argument("ref_b", metavar="REF2")
@click.option(
    "--layers", "per_layer", is_flag=True, help="Also compare every target layer: source layers and held-out R2."
)
@db_option
@format_option
def diff(ref_a, ref_b, per_layer, db, output_format):
    """Compare two mapper versions side by side: calibration, fit options, whole-mapper metrics (the
    newest of each), and with --layers every target layer.

    \b
    kvhub diff qwen2.5-coder-0.5b-instruct:qwen2.5-coder-1.5b-instruct:legal-docs@v1 ...:legal-docs@v2
    kvhub diff REF1 REF2 --layers --format tsv

    DELTA is REF2 minus REF1 where both are numbers; CHANGED marks rows that differ.  JSON: {"refs":
    [REF1, REF2], "rows": [{"field", "a", "b", "delta", "changed"}]} with the values unformatted.
    """
    from kvhub.store.compare import compare_versions

    with open_db(db, create=False) as store:
        first, second = (store.describe(ref, history=False) for ref in (ref_a, ref_b))
    rows = compare_versions(first, second, per_layer=per_layer)
    if output_format == "json":
        echo_json({"refs": [first["ref"], second["ref"]], "rows": rows})
        return
    table = [
        [
            row["field"],
            _shown(row["a"], output_format),
            _shown(row["b"], output_format),
            _number(row["delta"], output_format),
            "*" if row["changed"] else "",
        ]
        for row in rows
    ]
    print_table(["FIELD", "REF1", "REF2", "DELTA", "CHANGED"], table, output_format=output_format, right=("DELTA",))


def _shown(value, output_format: str) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _number(value, output_format)
    return "" if value is None else str(value)
