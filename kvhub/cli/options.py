"""Options more than one command family shares: ``--db`` and the store it names; the results document's
``--output-path`` and ``--log-samples`` (``kvhub eval``, ``kvhub eval-serve``)."""

from __future__ import annotations

from pathlib import Path

import click

DB_HELP = ("Store URL or SQLite path (default: $KVHUB_DB_URL, else $KVHUB_HOME/kvhub.db, else the user data "
           "dir). Commands that only read refuse a path where no store exists.")

db_option = click.option("--db", default=None, metavar="URL", help=DB_HELP)


def open_db(db: str | None, *, create: bool = True):
    """The store ``--db`` names (kvhub.store.open_store, imported only when a command runs); ``create=False``
    for commands that only read, so a mistyped --db is refused instead of becoming a new empty store."""
    from kvhub.store import open_store

    return open_store(db, create=create)


def output_path_option(directory: str):
    """``--output-path``; ``directory``: what a directory PATH gets (the results file under it)."""
    return click.option("--output-path", type=click.Path(path_type=Path), default=None, metavar="PATH",
                        help="Also write the results document: PATH ending in .json is the file, else a directory "
                             f"that gets {directory}.")


def log_samples_option(record: str):
    """``--log-samples``; ``record``: what one item's record holds."""
    return click.option("--log-samples", is_flag=True,
                        help=f"With --output-path: write every item's record ({record}) to samples_<task>_<date>.jsonl "
                             "beside the results.")
