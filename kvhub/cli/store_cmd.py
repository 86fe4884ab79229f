"""Store commands: list, show, tag, untag, rm, gc, export, import, db upgrade|current.

References everywhere read ``SRC:DST[:CALIB][@SELECTOR]`` (see ``kvhub show --help``); every command
takes ``--db URL`` (a SQLAlchemy URL or a SQLite path).  Tables go to stdout for people, ``--json``
for scripts; messages about what happened go to stderr.
"""

from __future__ import annotations

import json
from datetime import datetime

import click

from .console import console, err_console, plain, say

_DB_HELP = "Store URL or SQLite path (default: $KVHUB_DB_URL, else $KVHUB_HOME/kvhub.db, else the user data dir)."
_REF_HELP = """\b
REF is SRC:DST[:CALIB][@SELECTOR]:
  SRC, DST  model id (Qwen/Qwen2.5-Coder-0.5B-Instruct) or short name (qwen2.5-coder-0.5b-instruct)
  CALIB     calibration set; optional when the pair has one
  SELECTOR  v3 (a version), latest, production, or any alias; default: production if set, else latest"""

db_option = click.option("--db", default=None, metavar="URL", help=_DB_HELP)
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON on stdout instead of a table.")


def _open(db):
    from ..store import open_store

    return open_store(db)


def _echo_json(data) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


def _row(table, *cells) -> None:
    """Add a table row shown verbatim (names from the store are never read as Rich markup)."""
    table.add_row(*(plain(cell) for cell in cells))


def _size(num_bytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if num_bytes < 1024 or unit == "GB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes} B"


def _when(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%d %H:%M")


def _number(value) -> str:
    return "" if value is None else f"{value:.4g}"


# ---- list / show ---------------------------------------------------------------------------------
_HEADLINE = ("heldout_r2_k_mean", "heldout_r2_v_mean")


def _parse_thresholds(pairs: tuple[str, ...]) -> dict[str, float]:
    from ..errors import ConfigError

    import math

    thresholds = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not name.strip() or not math.isfinite(number):
            raise ConfigError(f"--min-metric {pair!r}: write NAME=VALUE with a finite number, "
                              "e.g. heldout_r2_k_mean=0.9")
        thresholds[name.strip()] = number
    return thresholds


@click.command("list")
@click.option("--src", default=None, help="Source model: full id or short name.")
@click.option("--dst", default=None, help="Target model: full id or short name.")
@click.option("--calib", default=None, help="Calibration-set name.")
@click.option("--family", default=None, help="Model family of the source (qwen2, llama, ...).")
@click.option("--min-metric", "min_metrics", multiple=True, metavar="NAME=VALUE",
              help="Keep versions with a measurement NAME >= VALUE (repeatable).")
@db_option
@json_option
def list_versions(src, dst, calib, family, min_metrics, db, as_json):
    """List mapper versions in the store, oldest first within each model pair.

    \b
    kvhub list
    kvhub list --src qwen2.5-coder-0.5b-instruct --min-metric heldout_r2_k_mean=0.9 --json
    """
    with _open(db) as store:
        versions = store.versions(source=src, target=dst, calibration=calib, family=family,
                                  min_metrics=_parse_thresholds(min_metrics))
        summary = store.metric_summary(versions, list(_HEADLINE))
    if as_json:
        _echo_json([dict(v.to_dict(), metrics=summary.get(v.id, {})) for v in versions])
        return
    if not versions:
        say("no mapper versions match; fit one with `kvhub fit` or import one with `kvhub import DIR`")
        return
    console.print(_versions_table(versions, summary))


def _versions_table(versions, summary):
    from rich.table import Table

    table = Table(box=None, header_style="bold")
    table.add_column("REF", overflow="fold")  # a reference is copied from here: wrap it, never cut it
    table.add_column("ALIASES", overflow="fold")
    table.add_column("CREATED", no_wrap=True)
    for column in ("K", "LAMBDA", "R2 K", "R2 V", "SIZE"):
        table.add_column(column, justify="right", no_wrap=True)
    short_names = {v.short_ref for v in versions}
    unambiguous = len(short_names) == len({v.ref for v in versions})
    for v in versions:
        metrics = summary.get(v.id, {})
        _row(table, 
            v.short_ref if unambiguous else v.ref, ", ".join(v.aliases), _when(v.created_at),
            "" if v.k is None else str(v.k), _number(v.ridge_lambda), _number(metrics.get(_HEADLINE[0])),
            _number(metrics.get(_HEADLINE[1])), _size(v.artifact_bytes),
        )
    return table


@click.command(epilog=_REF_HELP)
@click.argument("ref")
@click.option("--verify", is_flag=True, help="Also hash every file of the artifact.")
@db_option
@json_option
def show(ref, verify, db, as_json):
    """Show everything about one mapper version: models, calibration set, selected layers, metrics,
    lineage, aliases and Hub publications.

    \b
    kvhub show qwen2.5-coder-0.5b-instruct:qwen2.5-coder-1.5b-instruct:legal-docs@v3
    """
    with _open(db) as store:
        data = store.describe(ref)
        if verify:
            store.verify(data["ref"])
    if as_json:
        _echo_json(data)
        return
    _print_description(data)
    if verify:
        say("artifact verified: every file matches its recorded sha256 and the artifact format")


def _print_description(data: dict) -> None:
    from rich.table import Table

    overview = Table(box=None, show_header=False)
    overview.add_column(style="bold", no_wrap=True)
    overview.add_column(overflow="fold")
    for label, value in _overview_rows(data):
        _row(overview, label, value)
    console.print(overview)
    layers = Table(title="selected layers", box=None, header_style="bold", title_justify="left")
    for column in ("TARGET", "SOURCES", "LAMBDA K", "LAMBDA V", "R2 K", "R2 V"):
        layers.add_column(column)
    for layer in data["selected_layers"]:
        _row(layers, str(layer.get("target")), ",".join(map(str, layer.get("sources", []))),
                       _number(layer.get("lambda_k")), _number(layer.get("lambda_v")),
                       _number(layer.get("r2_k")), _number(layer.get("r2_v")))
    console.print(layers)
    console.print(_metrics_table(data["metrics"]))
    for publication in data["publications"]:
        console.print(f"published: {publication['repo_id']}@{publication['revision']} "
                      f"(commit {str(publication['commit_sha'])[:12]}, {publication['published_at'][:16]})",
                      highlight=False, markup=False)


def _overview_rows(data: dict) -> list[tuple[str, str]]:
    src, dst, calib = data["source_model"], data["target_model"], data["calibration_set"]
    geometry = "{num_layers} layers x {num_kv_heads} KV heads x {head_dim}"
    return [
        ("reference", data["ref"]),
        ("aliases", ", ".join(data["aliases"]) or "-"),
        ("created", data["created_at"]),
        ("source", f"{src['name']} @ {src['revision'] or '-'} ({src['model_type']}, {geometry.format(**src)})"),
        ("target", f"{dst['name']} @ {dst['revision'] or '-'} ({dst['model_type']}, {geometry.format(**dst)})"),
        ("calibration", f"{calib['name']} v{calib['version']} ({calib['tokens']} tokens, "
                        f"content {str(calib['content_hash'])[:12]})"),
        ("k / lambda", f"{'auto' if data['k'] is None else data['k']} / "
                       f"{'auto' if data['ridge_lambda'] is None else _number(data['ridge_lambda'])}"
                       + (" (chosen per target layer, below)" if data['k'] is None or data['ridge_lambda'] is None else "")),
        ("artifact", f"{data['artifact_path']} ({_size(data['artifact_bytes'])})"),
        ("sha256", f"{data['artifact_sha256']} (tensors {data['tensors_sha256']})"),
        ("written by", f"kvhub {data['kvhub_version']}, artifact format {data['format_version']}"),
        ("lineage", json.dumps(data["lineage"], sort_keys=True) if data["lineage"] else "-"),
    ]


def _metrics_table(metrics: list[dict]):
    from rich.table import Table

    table = Table(title="metrics", box=None, header_style="bold", title_justify="left")
    for column in ("NAME", "VALUE", "SPLIT", "TASK", "LAYER", "N", "MEASURED"):
        table.add_column(column)
    for m in sorted(metrics, key=lambda m: (m["layer"] is not None, m["name"], m["layer"] or 0)):
        _row(table, m["name"], _number(m["value"]), m["split"] or "", m["task"] or "",
                      "" if m["layer"] is None else str(m["layer"]), "" if m["n"] is None else str(m["n"]),
                      m["measured_at"][:16])
    return table


# ---- aliases and removal -------------------------------------------------------------------------
@click.command(epilog=_REF_HELP)
@click.argument("ref")
@click.argument("alias")
@db_option
def tag(ref, alias, db):
    """Point ALIAS (production, staging, any name) of REF's model pair and calibration set at REF.

    \b
    kvhub tag qwen2.5-coder-0.5b-instruct:qwen2.5-coder-1.5b-instruct:legal-docs@v3 production

    An alias names one version per pair and calibration set; tagging moves it.  `latest` is kept by
    the store itself.  kvhub.load() uses `production` when it is set.
    """
    with _open(db) as store:
        version = store.tag(ref, alias)
        say(f"{alias} -> {store.reference(version)}")


@click.command(epilog=_REF_HELP)
@click.argument("ref")
@click.argument("alias")
@db_option
def untag(ref, alias, db):
    """Remove ALIAS from REF's model pair and calibration set.

    \b
    kvhub untag qwen2.5-coder-0.5b-instruct:qwen2.5-coder-1.5b-instruct:legal-docs production
    kvhub untag ...:legal-docs@v3 production     (only if production points at v3)
    """
    with _open(db) as store:
        version = store.untag(ref, alias)
        say(f"removed {alias} (it pointed at {store.reference(version)})")


@click.command(epilog=_REF_HELP)
@click.argument("ref")
@click.option("--force", is_flag=True, help="Remove even if an alias such as production points at it.")
@db_option
def rm(ref, force, db):
    """Remove mapper version REF: its row, metrics, aliases, and its artifact unless shared.

    \b
    kvhub rm qwen2.5-coder-0.5b-instruct:qwen2.5-coder-1.5b-instruct:legal-docs@v2

    Refuses while an alias other than `latest` points at it (unless --force).  Version numbers are
    never reused; `latest` moves to the newest remaining version.
    """
    with _open(db) as store:
        version = store.remove(ref, force=force)
    say(f"removed {version.ref} ({_size(version.artifact_bytes)})")


@click.command()
@click.option("--dry-run", is_flag=True, help="Only report what would be removed.")
@db_option
@json_option
def gc(dry_run, db, as_json):
    """Delete artifact directories no version references, and leftovers of interrupted writes.

    \b
    kvhub gc --dry-run
    kvhub gc

    Never touches an artifact a version references; waits for registrations in flight.
    """
    with _open(db) as store, err_console.status("collecting unreferenced artifacts"):
        report = store.gc(dry_run=dry_run)
    if as_json:
        _echo_json({"dry_run": report.dry_run, "artifacts": [dict(location=l, bytes=b) for l, b in report.artifacts],
                    "temporaries": [dict(name=n, bytes=b) for n, b in report.temporaries],
                    "missing": report.missing, "bytes": report.bytes})
        return
    verb = "would remove" if dry_run else "removed"
    say(f"{verb} {len(report.artifacts)} unreferenced artifacts and {len(report.temporaries)} "
        f"leftovers ({_size(report.bytes)})")
    for location in report.missing:
        say(f"{location} is referenced but missing; re-import it or `kvhub rm` its version", label="warning:",
            style="yellow")


# ---- moving artifacts in and out -----------------------------------------------------------------
@click.command("export", epilog=_REF_HELP)
@click.argument("ref")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--force", is_flag=True, help="Replace DIRECTORY if it exists.")
@db_option
def export_version(ref, directory, force, db):
    """Copy the artifact of REF to DIRECTORY (verified byte for byte).

    \b
    kvhub export qwen2.5-coder-0.5b-instruct:qwen2.5-coder-1.5b-instruct:legal-docs@production ./mapper
    """
    with _open(db) as store, err_console.status(plain(f"exporting {ref}")):
        path = store.export(ref, directory, overwrite=force)
    say(f"exported {ref} to {path}")


@click.command("import")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@db_option
@json_option
def import_artifact(directory, db, as_json):
    """Register an artifact directory (mapper.json + mapper.safetensors) as a new version.

    \b
    kvhub import ./mapper

    The directory is copied into the store; importing the same artifact again changes nothing.
    """
    from pathlib import Path

    with _open(db) as store, err_console.status(plain(f"importing {directory}")):
        version = store.register(directory, lineage={"imported_from": str(Path(directory).resolve())})
        reference = store.reference(version)
    if as_json:
        _echo_json(version.to_dict())
    else:
        say(f"registered {reference}")


# ---- schema --------------------------------------------------------------------------------------
@click.group()
def db():
    """Schema of the store database: `kvhub db upgrade`, `kvhub db current`."""


@db.command()
@db_option
def upgrade(db):
    """Migrate the store's schema to this kvhub's version (creates a new database).

    Back up the database first; stop other kvhub processes that use it.
    """
    from ..store.location import display_url, resolve_db_url
    from ..store.migrate import schema_status, upgrade as upgrade_schema

    url = resolve_db_url(db)
    before, head = schema_status(url)
    upgrade_schema(url)
    if before == head:
        say(f"{display_url(url)} is already at {head}")
    else:
        say(f"upgraded {display_url(url)} from {before or 'an empty database'} to {head}")


@db.command()
@db_option
@json_option
def current(db, as_json):
    """Print the schema revision of the store and whether it is this kvhub's head."""
    from ..store.location import display_url, resolve_db_url
    from ..store.migrate import is_known_revision, schema_status

    url = resolve_db_url(db)
    revision, head = schema_status(url)
    if as_json:
        _echo_json({"url": display_url(url), "current": revision, "head": head, "up_to_date": revision == head,
                    "newer_than_kvhub": not is_known_revision(revision)})
        return
    if not is_known_revision(revision):
        state = f"(newer than this kvhub's {head}: upgrade kvhub, `pip install -U kvhub`)"
    else:
        state = "(head)" if revision == head else f"(behind {head}: run `kvhub db upgrade`)"
    click.echo(f"{revision or 'empty database'} {state}")


def attach(group: click.Group) -> None:
    """Add the store commands to the ``kvhub`` group."""
    for command in (list_versions, show, tag, untag, rm, gc, export_version, import_artifact, db):
        group.add_command(command)
