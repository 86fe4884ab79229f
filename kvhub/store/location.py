"""Where the store lives: the database URL and the artifact directory.

Precedence for the database (first one set wins):

1. the ``db`` argument (``--db`` on the command line): a SQLAlchemy URL, or a plain file path
   which means a SQLite file;
2. ``KVHUB_DB_URL``;
3. ``$KVHUB_HOME/kvhub.db``;
4. ``<user data dir>/kvhub/kvhub.db`` (``$XDG_DATA_HOME`` or ``~/.local/share`` on Linux,
   ``~/Library/Application Support`` on macOS, ``%LOCALAPPDATA%`` on Windows).

Artifacts live in ``artifacts/`` next to a SQLite file.  For a server database (PostgreSQL) they live
in ``$KVHUB_ARTIFACTS``, else ``$KVHUB_HOME/artifacts``, else ``<user data dir>/kvhub/artifacts``;
machines sharing one PostgreSQL store must share that directory too.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from kvhub.errors import ConfigError

DB_FILE = "kvhub.db"
ARTIFACTS_DIR = "artifacts"


def user_data_dir() -> Path:
    """The per-user data directory of kvhub (not created here)."""
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local"
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Application Support"
    else:
        base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "kvhub"


def kvhub_home() -> Path:
    """``$KVHUB_HOME`` if set, else :func:`user_data_dir`."""
    home = os.environ.get("KVHUB_HOME")
    return Path(home).expanduser() if home else user_data_dir()


def resolve_db_url(db: str | os.PathLike | None = None) -> str:
    """The SQLAlchemy URL of the store, following the precedence in the module docstring."""
    if db is None:
        db = os.environ.get("KVHUB_DB_URL") or None
    if db is None:
        return sqlite_url(kvhub_home() / DB_FILE)
    text = os.fspath(db).strip()
    if not text:
        raise ConfigError("empty database URL; pass --db sqlite:///PATH or --db postgresql+psycopg://...")
    if "://" in text:
        return text
    return sqlite_url(Path(text).expanduser())


def require_existing(url: str) -> None:
    """Raise NotFoundError when ``url`` is a SQLite file that does not exist: commands that only read
    must not create a store (a mistyped --db would otherwise answer "no versions" from a new one)."""
    from sqlalchemy.exc import ArgumentError

    from kvhub.errors import NotFoundError

    try:
        path = sqlite_path(url)
    except ArgumentError:  # not a URL at all: opening it says so (kvhub.store.engine)
        return
    if path is not None and not path.exists():
        raise NotFoundError(
            f"no kvhub store at {path}; check --db / KVHUB_DB_URL / KVHUB_HOME (a new store is "
            "created only by commands that write one: `kvhub fit`, `kvhub import`, `kvhub pull`, "
            "`kvhub db upgrade`)"
        )


def sqlite_url(path: Path) -> str:
    """``sqlite:///`` URL of an absolute path."""
    return f"sqlite:///{path.resolve()}"


def sqlite_path(url: str) -> Path | None:
    """The file behind a SQLite URL; None for other databases and for in-memory SQLite."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return Path(parsed.database)


def default_artifacts_dir(url: str) -> Path:
    """Artifacts next to a SQLite file; for a server database see the module docstring."""
    path = sqlite_path(url)
    if path is not None:
        return path.parent / ARTIFACTS_DIR
    explicit = os.environ.get("KVHUB_ARTIFACTS")
    return Path(explicit).expanduser() if explicit else kvhub_home() / ARTIFACTS_DIR


def display_url(url: str) -> str:
    """The URL with any password masked, for messages."""
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)
