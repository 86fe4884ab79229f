"""SQLAlchemy engines for the store, with the per-database settings it relies on.

SQLite: foreign keys on, WAL journal, a 60 s busy timeout, and write transactions that start with
``BEGIN IMMEDIATE`` (a deferred transaction that later needs the write lock can fail with "database is
locked" without waiting; an immediate one queues for the lock up front).  Write sessions ask for that
with the ``kvhub_write`` execution option, see :func:`write_engine`.

A SQLite store kvhub may not write (a read-only mount, a file or folder without write permission) is
opened read-only (``mode=ro``; ``immutable=1`` when its folder is read-only too, since SQLite could
not create the WAL index there): reads work, and a write is refused with one line that says so.

A SQLite store on a full file system cannot even be read normally (SQLite must grow the ``-shm`` file
first): SQLite's "disk I/O error" or "database or disk is full" there is a "no space left on DIR" error,
and when nothing is pending in the write-ahead log the store is reopened read-only (``immutable=1``, a
fresh connection per use), so ``kvhub gc`` can still free space and every write says where space ran out.

PostgreSQL: plain ``READ COMMITTED``; concurrent writers serialise on the row locks the store takes.
"""

from __future__ import annotations

import os
import re
import sqlite3
from pathlib import Path
from urllib.parse import quote

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError
from sqlalchemy.pool import NullPool

from kvhub.artifact import files as artifact_files
from kvhub.errors import ConfigError, StoreError
from kvhub.store.location import display_url, sqlite_path

SQLITE_BUSY_TIMEOUT_S = 60.0
NEARLY_FULL_BYTES = 1 << 20  # below this much free space a SQLite I/O failure is taken for a full disk
_NO_SPACE_TEXT = ("disk i/o error", "database or disk is full")


def make_engine(url: str, *, foreign_keys: bool = True, out_of_space: bool = False) -> Engine:
    """Engine for ``url``; ``foreign_keys=False`` only for migrations (see migrations/env.py);
    ``out_of_space``: a SQLite store on a full file system, opened read-only (module docstring)."""
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        shown = re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)
        raise ConfigError(
            f"{shown!r} is not a database URL; use sqlite:///PATH or postgresql+psycopg://USER@HOST/DB"
        ) from exc
    if parsed.get_backend_name() == "sqlite":
        return _sqlite_engine(url, foreign_keys=foreign_keys, out_of_space=out_of_space)
    try:
        return create_engine(url, pool_pre_ping=True)
    except (NoSuchModuleError, ImportError) as exc:
        raise ConfigError(
            f"no driver for {display_url(url)} ({exc}); for PostgreSQL install `pip install 'kvhub[postgres]'` "
            "and use a postgresql+psycopg:// URL"
        ) from exc


def connection_error(url: str, exc: DBAPIError) -> StoreError:
    """The StoreError for a database that cannot be reached or used (password never shown)."""
    folder = full_folder(url, exc)
    if folder is not None:
        return no_space_error(folder)
    return StoreError(
        f"cannot use the store at {display_url(url)}: {str(exc.orig).strip()}; check the URL (--db, "
        "KVHUB_DB_URL), that the server is running, and your permissions"
    )


def full_folder(url: str, exc: DBAPIError) -> Path | None:
    """The folder of a SQLite store when ``exc`` is SQLite failing because its file system is full."""
    path = sqlite_path(url)
    if path is None or not any(text in str(exc.orig).lower() for text in _NO_SPACE_TEXT):
        return None
    try:
        stats = os.statvfs(path.parent)
    except OSError:
        return None
    return path.parent if stats.f_bavail * stats.f_frsize < NEARLY_FULL_BYTES else None


def no_space_error(folder: Path, *, then: str = "") -> StoreError:
    """kvhub.artifact.files.no_space_error; by default for a write to the store."""
    return artifact_files.no_space_error(
        folder,
        then=then
        or "nothing was written. Free some space there (`kvhub gc` removes unreferenced artifacts and leftovers "
        "of interrupted writes) and run the command again",
    )


def out_of_space_folder(engine: Engine) -> Path | None:
    """The folder of a store opened read-only because its file system is full (else None)."""
    folder = engine.get_execution_options().get("kvhub_out_of_space")
    return Path(folder) if folder else None


def is_read_only(engine: Engine) -> bool:
    """Whether ``engine`` opened a SQLite store read-only (see the module docstring)."""
    return bool(engine.get_execution_options().get("kvhub_read_only", False))


def read_only_error(url: str) -> StoreError:
    return StoreError(
        f"the store at {display_url(url)} is read-only (no write permission, or a read-only mount): "
        "list, show and load work, this command writes; run it where the store is writable"
    )


def _writable(path: Path) -> bool:
    """Whether this process may write the database file and create its journal files beside it."""
    return os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)


def wal_pending(path: Path) -> bool:
    """Whether the write-ahead log beside the SQLite file ``path`` holds commits (an immutable reader
    would not see them)."""
    wal = path.with_name(path.name + "-wal")
    return wal.exists() and wal.stat().st_size > 0


def _read_only_uri(path: Path) -> str:
    """``mode=ro``, plus ``immutable=1`` when the folder is read-only and no write-ahead log is pending
    (an immutable reader would not see what a log holds)."""
    immutable = not os.access(path.parent, os.W_OK) and not wal_pending(path)
    return f"file:{quote(str(path))}?mode=ro" + ("&immutable=1" if immutable else "")


def write_engine(engine: Engine) -> Engine:
    """The same engine, marked so SQLite transactions begin IMMEDIATE (no-op elsewhere)."""
    return engine.execution_options(kvhub_write=True)


def _sqlite_engine(url: str, *, foreign_keys: bool, out_of_space: bool = False) -> Engine:
    path = sqlite_path(url)
    read_only = path is not None and path.is_file() and (out_of_space or not _writable(path))
    if path is not None and out_of_space:
        # SQLite cannot grow the -shm file, so no locking: a fresh connection each time reads the file as it is
        uri = f"file:{quote(str(path))}?mode=ro&immutable=1"
        engine = create_engine(
            url,
            poolclass=NullPool,
            creator=lambda: sqlite3.connect(uri, uri=True, timeout=SQLITE_BUSY_TIMEOUT_S, check_same_thread=False),
        )
    elif path is not None and read_only:
        uri = _read_only_uri(path)
        engine = create_engine(
            url, creator=lambda: sqlite3.connect(uri, uri=True, timeout=SQLITE_BUSY_TIMEOUT_S, check_same_thread=False)
        )
    else:
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreError(
                    f"cannot create {path.parent} for the store ({exc}); pass --db with a writable path"
                ) from exc
        engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record) -> None:
        # Let SQLAlchemy's "begin" event (below) issue BEGIN instead of the sqlite3 module.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA foreign_keys={'ON' if foreign_keys else 'OFF'}")
        if path is not None and not read_only:
            cursor.execute("PRAGMA journal_mode=WAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection) -> None:
        immediate = connection.get_execution_options().get("kvhub_write", False)
        connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    if out_of_space and path is not None:
        return engine.execution_options(kvhub_read_only=True, kvhub_out_of_space=str(path.parent))
    return engine.execution_options(kvhub_read_only=True) if read_only else engine
