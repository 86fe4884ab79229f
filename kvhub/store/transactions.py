"""How the Store talks to its database: read transactions, and write transactions retried on a lost race.

:class:`Transactions` is the base of :class:`kvhub.store.store.Store`: it holds the engine and its two
session makers (reads; writes, which SQLite begins IMMEDIATE, see :func:`kvhub.store.engine.write_engine`)
and refuses a write up front on a store that is read-only or whose file system is full.  A write
transaction that loses a race (a duplicate insert of a new model or triple, a deadlock, a serialization
failure, SQLite's lock timeout) is rolled back and run again from the start, with jittered backoff.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Callable, TypeVar

from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from kvhub.errors import StoreError
from kvhub.store.engine import (
    connection_error,
    full_folder,
    is_read_only,
    no_space_error,
    out_of_space_folder,
    read_only_error,
    write_engine,
)
from kvhub.store.location import display_url

log = logging.getLogger(__name__)

T = TypeVar("T")
_RETRIES = 12
_RETRY_SQLSTATES = {"40001", "40P01", "23505"}  # serialization failure, deadlock, unique violation


def _retryable(exc: DBAPIError) -> bool:
    original = getattr(exc, "orig", None)
    if getattr(original, "sqlstate", None) in _RETRY_SQLSTATES:
        return True
    text = str(original).lower()
    return "database is locked" in text or "unique constraint failed" in text


class Transactions:
    """Read and write transactions on the database at ``url`` (``engine`` made by
    :func:`kvhub.store.engine.make_engine`)."""

    def __init__(self, url: str, *, engine: Engine):
        self.url = url
        self._engine = engine
        self._reader = sessionmaker(engine, expire_on_commit=False)
        self._writer = sessionmaker(write_engine(engine), expire_on_commit=False)

    def close(self) -> None:
        self._engine.dispose()

    def _read(self, work: Callable[[Session], T]) -> T:
        try:
            with self._reader() as session:
                return work(session)
        except DBAPIError as exc:
            raise connection_error(self.url, exc) from exc

    @property
    def read_only(self) -> bool:
        """True for a SQLite store this process may not write (opened read-only, see kvhub.store.engine)."""
        return is_read_only(self._engine)

    def _check_writable(self) -> None:
        folder = out_of_space_folder(self._engine)
        if folder is not None:
            raise no_space_error(folder)
        if self.read_only:
            raise read_only_error(self.url)

    def _write(self, work: Callable[[Session], T]) -> T:
        """Run ``work`` in a write transaction and commit; retry the whole of it on a lost race."""
        self._check_writable()
        for attempt in range(_RETRIES):
            with self._writer() as session:
                try:
                    result = work(session)
                    session.commit()
                    return result
                except DBAPIError as exc:
                    session.rollback()
                    if full_folder(self.url, exc) is not None:
                        raise connection_error(self.url, exc) from exc
                    if not _retryable(exc) or attempt == _RETRIES - 1:
                        raise StoreError(f"the store at {display_url(self.url)} refused a write: {exc.orig}") from exc
                    log.debug("retrying a store transaction after %s", exc.orig)
            time.sleep(min(2.0, 0.02 * 2**attempt) * random.uniform(0.5, 1.0))
        raise AssertionError("unreachable")
