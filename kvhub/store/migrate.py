"""Schema versions of the store: Alembic, run from the ``migrations`` package shipped in the wheel.

:func:`ensure_schema` is what opening a store does: a brand-new (empty) database is migrated to head;
a database whose schema is behind is refused with :class:`SchemaOutdatedError` ("run `kvhub db
upgrade`"); one written by a newer kvhub is refused too.  Upgrades are explicit because they can take
a while on a large PostgreSQL store and other kvhub processes may still be running the old code.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from pathlib import Path

from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError

from kvhub.errors import SchemaOutdatedError, StoreError
from kvhub.store.engine import connection_error, make_engine
from kvhub.store.location import display_url

log = logging.getLogger(__name__)

VERSION_TABLE = "kvhub_alembic_version"  # also named in migrations/env.py
# The newest revision in migrations/versions.  Opening a store compares against this constant, so the
# common case (schema current) never imports Alembic; a test keeps it equal to Alembic's own head.
SCHEMA_HEAD = "0003_map_kind"


def migrations_dir() -> Path:
    """The repository's ``migrations/`` folder, installed as ``kvhub._migrations`` (setup.py)."""
    from kvhub import _migrations as migrations

    return Path(migrations.__file__).resolve().parent


def alembic_config(url: str, **attributes):
    """An Alembic Config for ``url`` without any alembic.ini; ``attributes`` reach migrations/env.py."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    # ConfigParser interpolation would eat a '%' in a password.
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    config.attributes.update(attributes)
    return config


@lru_cache(maxsize=1)
def head_revision() -> str:
    """The newest schema revision this kvhub knows."""
    return _script().get_current_head()


@lru_cache(maxsize=1)
def _script():
    from alembic.script import ScriptDirectory

    return ScriptDirectory(str(migrations_dir()))


def current_revision(connection: Connection) -> str | None:
    """The revision stamped in the database; None for a database kvhub never migrated."""
    from alembic.runtime.migration import MigrationContext

    context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
    heads = context.get_current_heads()
    if len(heads) > 1:
        raise StoreError(f"the store has several schema heads {heads}; run `kvhub db upgrade`")
    return heads[0] if heads else None


def schema_status(url: str) -> tuple[str | None, str]:
    """(revision stamped in the database or None, head revision of this kvhub); never migrates."""
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            return current_revision(connection), head_revision()
    except DBAPIError as exc:
        raise connection_error(url, exc) from exc
    finally:
        engine.dispose()


def is_known_revision(revision: str | None) -> bool:
    """True for no revision (an empty database) and for every revision this kvhub's migrations know."""
    return revision is None or revision in {rev.revision for rev in _script().walk_revisions()}


def upgrade(url: str, *, revision: str = "head") -> None:
    """Migrate the database at ``url`` up to ``revision`` (default: head).

    A database stamped by a newer kvhub is refused with "upgrade kvhub": its revision is not one these
    migrations can start from.
    """
    from alembic import command

    current, _ = schema_status(url)
    if current is not None and not is_known_revision(current):
        raise _newer_error(current, display_url(url))
    _run_alembic(command.upgrade, url, revision)


def downgrade(url: str, *, revision: str) -> None:
    """Migrate the database at ``url`` down to ``revision`` ("base" drops every kvhub table)."""
    from alembic import command

    _run_alembic(command.downgrade, url, revision)


def _run_alembic(action, url: str, revision: str) -> None:
    from alembic.util import CommandError

    try:
        action(alembic_config(url), revision)
    except CommandError as exc:
        raise StoreError(f"schema migration of {display_url(url)} to {revision!r} failed: {exc}") from exc
    except DBAPIError as exc:
        raise StoreError(
            f"schema migration of {display_url(url)} to {revision!r} failed and was rolled back: "
            f"{str(exc.orig).strip()}"
        ) from exc


def _stamped(connection: Connection) -> str | None:
    """The revision in the version table, read with plain SQL (None without the table)."""
    if not inspect(connection).has_table(VERSION_TABLE):
        return None
    return connection.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar()


def ensure_schema(engine: Engine, url: str) -> None:
    """Create a brand-new database at head; refuse one whose schema is not head."""
    with engine.connect() as connection:
        if _stamped(connection) == SCHEMA_HEAD:
            return
        current = current_revision(connection)
    if current == head_revision():
        return
    if current is None:
        _create(url)
        return
    raise _schema_error(current, url)


def _create(url: str) -> None:
    """Migrate an unstamped database to head.

    The upgrade re-reads the stamp under its lock, so when several processes open a new database at
    once, one creates the schema and the others find it done.  A database holding tables of the same
    names but no stamp makes the upgrade fail (and roll back): that is not a kvhub store.
    """
    log.info("creating the kvhub store schema in %s", display_url(url))
    try:
        upgrade(url)
    except StoreError as exc:
        raise StoreError(
            f"{display_url(url)} holds no kvhub schema version, and creating the schema failed ({exc}); "
            "if it holds another application's tables, point --db at a new or empty database"
        ) from exc


def _newer_error(current: str, where: str) -> StoreError:
    return StoreError(
        f"{where} has schema revision {current}, newer than this kvhub knows ({head_revision()}): a newer kvhub "
        "wrote it. Upgrade kvhub (`pip install -U kvhub`); `kvhub db upgrade` cannot help"
    )


def _schema_error(current: str, url: str) -> StoreError:
    where = display_url(url)
    if not is_known_revision(current):
        return _newer_error(current, where)
    return SchemaOutdatedError(
        f"{where} has schema revision {current}, this kvhub needs {head_revision()}; "
        "back it up, then run `kvhub db upgrade` (with the same --db)"
    )
