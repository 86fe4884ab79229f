"""Store commands: list, show, diff (kvhub.cli.inspect_cmd: reading), tag, untag, rm, gc, export, import,
db upgrade|current (here: changing the store).

References everywhere read ``SRC:DST[:CALIB][@SELECTOR]`` (see ``kvhub show --help``); every command
takes ``--db URL`` (a SQLAlchemy URL or a SQLite path).  Data goes to stdout as a table for people or
``--format json|tsv`` for scripts (kvhub.cli.output); messages about what happened go to stderr.

JSON vocabulary, shared with fit, push and pull: ``ref`` (the full reference), ``version`` (the number
in ``@vN``, never a database id), ``metrics`` (a list of {name, value, split, task, layer, n, seed,
measured_at, kvhub_version}), ``k``/``lambda`` (``"auto"`` when chosen per target layer; list and show
also keep ``ridge_lambda``, lambda's former name there).
"""

from __future__ import annotations

import os

import click

from kvhub.cli.console import err_console, plain, say
from kvhub.cli.inspect_cmd import diff, list_versions, show
from kvhub.cli.options import REF_HELP, db_option, one_value, open_db
from kvhub.cli.output import format_option, format_size, json_ref, print_record, version_json


# ---- aliases and removal -------------------------------------------------------------------------
@click.command(epilog=REF_HELP)
@click.argument("ref")
@click.argument("alias")
@db_option
@format_option
def tag(ref, alias, db, output_format):
    """Point ALIAS (production, staging, any name) of REF's model pair and calibration set at REF.

    \b
    kvhub tag qwen2.5-coder-0.5b-instruct:qwen2.5-coder-1.5b-instruct:legal-docs@v3 production

    An alias names one version per pair and calibration set; tagging moves it.  `latest` is kept by
    the store itself.  kvhub.load() uses `production` when it is set.
    """
    with open_db(db, create=False) as store:
        version = store.tag(ref, alias)
        reference = store.reference(version)
    if not print_record({"ref": json_ref(version), "alias": alias}, output_format=output_format):
        say(f"{alias} -> {reference}")


@click.command(epilog=REF_HELP)
@click.argument("ref")
@click.argument("alias")
@db_option
@format_option
def untag(ref, alias, db, output_format):
    """Remove ALIAS from REF's model pair and calibration set.

    \b
    kvhub untag qwen2.5-coder-0.5b-instruct:qwen2.5-coder-1.5b-instruct:legal-docs production
    kvhub untag ...:legal-docs@v3 production     (only if production points at v3)
    """
    with open_db(db, create=False) as store:
        version = store.untag(ref, alias)
        reference = store.reference(version)
    if not print_record({"ref": json_ref(version), "removed_alias": alias}, output_format=output_format):
        say(f"removed {alias} (it pointed at {reference})")


@click.command(epilog=REF_HELP)
@click.argument("ref")
@click.option("--force", is_flag=True, help="Remove even if an alias such as production points at it.")
@db_option
@format_option
def rm(ref, force, db, output_format):
    """Remove mapper version REF: its row, metrics, aliases, and its artifact unless shared.

    \b
    kvhub rm qwen2.5-coder-0.5b-instruct:qwen2.5-coder-1.5b-instruct:legal-docs@v2

    REF must name the version (@v2, or an alias such as @latest): without a selector rm refuses
    rather than pick one.  Refuses while an alias other than `latest` points at it (unless --force).
    Version numbers are never reused; `latest` moves to the newest remaining version.
    """
    from kvhub.errors import ConfigError
    from kvhub.store.refs import Ref

    parsed = Ref.parse(ref)
    with open_db(db, create=False) as store:
        if parsed.version is None and parsed.alias is None:
            latest = store.resolve(parsed.with_selector(alias="latest"))  # names what exists (or why not)
            raise ConfigError(
                f"{ref!r} names no version; `kvhub rm` removes exactly one: add it, e.g. "
                f"`kvhub rm {ref}@v{latest.version}` (the latest; `kvhub list --src {parsed.source}` "
                "shows them all)"
            )
        version = store.remove(ref, force=force)
    if not print_record(
        {"ref": json_ref(version), "removed": True, "bytes": version.artifact_bytes}, output_format=output_format
    ):
        say(f"removed {version.ref} ({format_size(version.artifact_bytes)})")


@click.command()
@click.option("--dry-run", is_flag=True, help="Only report what would be removed.")
@click.option(
    "--hub-cache",
    is_flag=True,
    help="Also delete the Hugging Face cache's copies of pulled mappers that the store holds (a pull keeps "
    "both; the cache's copy only serves an offline re-pull).",
)
@db_option
@format_option
def gc(dry_run, hub_cache, db, output_format):
    """Delete artifact directories no version references, and leftovers of interrupted writes.

    \b
    kvhub gc --dry-run
    kvhub gc
    kvhub gc --hub-cache

    Never touches an artifact a version references; waits for registrations in flight.  Also removes the
    spools of two-phase fits (the source's captures, under the kvhub cache) that no fit has written for a day.
    """
    from kvhub.fitting.spool import sweep

    with open_db(db, create=False) as store, err_console.status("collecting unreferenced artifacts"):
        report = store.gc(dry_run=dry_run)
        cached = _hub_cache_copies(store, dry_run=dry_run) if hub_cache else None
        spools = [(path, _tree_bytes(path)) for path in sweep(dry_run=True)]
        if not dry_run:
            sweep()
    copies = cached.copies if cached is not None else []
    skipped = cached.skipped if cached is not None else []
    if print_record(
        {
            "dry_run": report.dry_run,
            "artifacts": [dict(location=l, bytes=b) for l, b in report.artifacts],
            "temporaries": [dict(name=n, bytes=b) for n, b in report.temporaries],
            "missing": report.missing,
            "bytes": report.bytes,
            "hub_cache": [dict(repo_id=c.repo_id, commit=c.commit, ref=c.ref, bytes=c.bytes) for c in copies],
            "hub_cache_skipped": [
                dict(repo_id=s.repo_id, commit=s.commit, path=s.path, reason=s.reason) for s in skipped
            ],
            "spools": [dict(path=str(p), bytes=b) for p, b in spools],
        },
        output_format=output_format,
    ):
        return
    verb = "would remove" if dry_run else "removed"
    say(
        f"{verb} {len(report.artifacts)} unreferenced artifacts and {len(report.temporaries)} "
        f"leftovers ({format_size(report.bytes)})"
    )
    if hub_cache:
        say(
            f"{verb} {len(copies)} copies of pulled mappers from the Hugging Face cache "
            f"({format_size(sum(c.bytes for c in copies))})"
        )
    if spools:
        say(f"{verb} {len(spools)} stale fit spools ({format_size(sum(b for _, b in spools))})")
    for refused in skipped:
        say(refused.reason, label="warning:", style="yellow")
    for location in report.missing:
        say(
            f"{location} is referenced but missing; re-import it or `kvhub rm` its version",
            label="warning:",
            style="yellow",
        )


def _tree_bytes(directory) -> int:
    """Bytes of the regular files directly in ``directory`` (a spool holds no subdirectories; links count 0)."""
    return sum(p.lstat().st_size for p in directory.iterdir() if p.is_file() and not p.is_symlink())


def _hub_cache_copies(store, *, dry_run: bool):
    """The Hugging Face cache's copies of mappers the store holds, deleted unless ``dry_run``, and the cached
    revisions that are not the cache's own layout (neither read nor deleted: kvhub.hub.cache)."""
    from kvhub.hub.cache import drop_copies, stored_copies
    from kvhub.hub.client import hub_settings

    cache_dir = hub_settings().cache_dir
    found = stored_copies(store, cache_dir=cache_dir)
    if not dry_run:
        drop_copies(found.copies, cache_dir=cache_dir)
    return found


# ---- moving artifacts in and out -----------------------------------------------------------------
@click.command("export", epilog=REF_HELP)
@click.argument("ref")
@click.argument("directory", type=click.Path(file_okay=False), required=False)
@click.option(
    "--out",
    "out",
    type=click.Path(file_okay=False),
    default=None,
    help="The directory, as fit and report name it (the same as the DIRECTORY argument).",
)
@click.option("--force", is_flag=True, help="Replace DIRECTORY if it exists.")
@db_option
@format_option
def export_version(ref, directory, out, force, db, output_format):
    """Copy the artifact of REF to DIRECTORY (verified byte for byte).

    \b
    kvhub export qwen2.5-coder-0.5b-instruct:qwen2.5-coder-1.5b-instruct:legal-docs@production ./mapper
    kvhub export qwen2.5-coder-0.5b-instruct:qwen2.5-coder-1.5b-instruct:legal-docs@v3 --out ./mapper
    """
    directory = one_value(directory, out, what="the directory", argument="DIRECTORY", option="--out")
    from kvhub.errors import ConfigError

    if os.path.lexists(directory) and not force:  # bad input (exit 2), as fit --out; the library's names overwrite=True
        raise ConfigError(f"{directory} already exists: pass --force to replace it, or export to another directory")
    with open_db(db, create=False) as store, err_console.status(plain(f"exporting {ref}")):
        version = store.resolve(ref)
        path = store.export(ref, directory, overwrite=force)
    if not print_record({"ref": json_ref(version), "directory": str(path)}, output_format=output_format):
        say(f"exported {ref} to {path}")


@click.command("import")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@db_option
@format_option
def import_artifact(directory, db, output_format):
    """Register an artifact directory (mapper.json + mapper.safetensors) as a new version.

    \b
    kvhub import ./mapper

    The directory is copied into the store.  An artifact whose tensors the store already holds for the
    same models and calibration set is that version (nothing changes; other files such as figures
    are not added to it).  JSON: the version, with ``already_registered``.
    """
    from pathlib import Path

    with open_db(db) as store, err_console.status(plain(f"importing {directory}")):
        existing = store.registered_as(directory)
        version = existing or store.register(directory, lineage={"imported_from": str(Path(directory).resolve())})
        reference = store.reference(version)
    if print_record(dict(version_json(version), already_registered=existing is not None), output_format=output_format):
        return
    say(
        f"{directory} holds the tensors of {reference}; nothing to do"
        if existing is not None
        else f"registered {reference}"
    )


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
    from kvhub.store.location import display_url, resolve_db_url
    from kvhub.store.migrate import schema_status, upgrade as upgrade_schema

    url = resolve_db_url(db)
    before, head = schema_status(url)
    upgrade_schema(url)
    if before == head:
        say(f"{display_url(url)} is already at {head}")
    else:
        say(f"upgraded {display_url(url)} from {before or 'an empty database'} to {head}")


@db.command()
@db_option
@format_option
def current(db, output_format):
    """Print the schema revision of the store and whether it is this kvhub's head."""
    from kvhub.store.location import display_url, resolve_db_url
    from kvhub.store.migrate import is_known_revision, schema_status

    from kvhub.store.location import require_existing

    url = resolve_db_url(db)
    require_existing(url)
    revision, head = schema_status(url)
    if print_record(
        {
            "url": display_url(url),
            "current": revision,
            "head": head,
            "up_to_date": revision == head,
            "newer_than_kvhub": not is_known_revision(revision),
        },
        output_format=output_format,
    ):
        return
    if not is_known_revision(revision):
        state = f"(newer than this kvhub's {head}: upgrade kvhub, `pip install -U kvhub`)"
    else:
        state = "(head)" if revision == head else f"(behind {head}: run `kvhub db upgrade`)"
    click.echo(f"{revision or 'empty database'} {state}")


def attach(group: click.Group) -> None:
    """Add the store commands to the ``kvhub`` group."""
    for command in (list_versions, show, diff, tag, untag, rm, gc, export_version, import_artifact, db):
        group.add_command(command)
