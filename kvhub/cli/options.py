"""Options more than one command family shares: ``--db`` and the store it names."""

from __future__ import annotations

import click

DB_HELP = ("Store URL or SQLite path (default: $KVHUB_DB_URL, else $KVHUB_HOME/kvhub.db, else the user data "
           "dir). Commands that only read refuse a path where no store exists.")

db_option = click.option("--db", default=None, metavar="URL", help=DB_HELP)


def open_db(db: str | None, *, create: bool = True):
    """The store ``--db`` names (kvhub.store.open_store, imported only when a command runs); ``create=False``
    for commands that only read, so a mistyped --db is refused instead of becoming a new empty store."""
    from kvhub.store import open_store

    return open_store(db, create=create)
