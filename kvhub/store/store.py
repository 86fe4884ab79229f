"""The Store: mapper versions in a SQL database, their artifacts in a content-addressed directory.

Registration protocol (what makes a killed process harmless):

1. take the artifact directory's shared lock (gc takes it exclusive);
2. copy the artifact into ``.tmp``, hashing while copying; check mapper.json against the hashes;
   fsync; rename into ``sha256/<2 hex>/<digest>`` (or reuse an identical stored copy);
3. in one transaction: get-or-create model and calibration rows, take the next version number from
   the series counter, insert the version row and its metrics, move ``latest``; commit;
4. release the lock.

A kill before 3 commits leaves no row, only an unreferenced directory or ``.tmp`` debris, which
``gc`` removes (it holds the exclusive lock, so nothing it sees is in flight).  Transactions that lose
a race (a duplicate insert of a new model or triple, a deadlock, SQLite's lock timeout) are retried
(:mod:`kvhub.store.transactions`, the Store's base).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import cast

from sqlalchemy import Table, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from kvhub import __version__
from kvhub.artifact import read_artifact, read_metadata
from kvhub.errors import AmbiguousError, ArtifactError, ConfigError, NotFoundError, StoreError
from kvhub.store import lookup, queries
from kvhub.store.artifact_io import export_artifact, trusted_tensor_file
from kvhub.store.artifacts import ArtifactStore, GcReport
from kvhub.store.engine import (
    connection_error,
    full_folder,
    make_engine,
    no_space_error,
    out_of_space_folder,
    wal_pending,
)
from kvhub.store.ingest import (
    METADATA_FILE,
    check_same_text,
    check_storable,
    find_same_tensors,
    insert_version,
    lock_series,
    metric_row,
    read_checked_metadata,
    set_alias,
)
from kvhub.store.location import default_artifacts_dir, display_url, require_existing, resolve_db_url, sqlite_path
from kvhub.store.migrate import ensure_schema
from kvhub.store.records import MapperVersion, version_record
from kvhub.store.refs import LATEST, Ref, check_alias_name
from kvhub.store.tables import AliasRow, PublicationRow, StorePropertyRow, VersionRow
from kvhub.store.transactions import Transactions

log = logging.getLogger(__name__)

VersionLike = MapperVersion | Ref | str
_COLLECT_WAIT_S = 2.0  # rm waits this long for registrations in flight, then leaves the artifact to gc


def open_store(
    db: str | os.PathLike | None = None, *, artifacts_dir: str | os.PathLike | None = None, create: bool = True
) -> "Store":
    """Open the store at ``db`` (see kvhub.store.location for the default), creating a new one at head
    unless ``create=False`` (then a SQLite file that does not exist is a NotFoundError).

    Raises SchemaOutdatedError when the database needs ``kvhub db upgrade``.
    """
    url = resolve_db_url(db)
    if not create:
        require_existing(url)
    engine = make_engine(url)
    try:
        store_id = _store_id(engine, url)
    except DBAPIError as exc:
        folder = full_folder(url, exc)
        path = sqlite_path(url)
        if folder is None or path is None or wal_pending(path):
            raise connection_error(url, exc) from exc
        engine = make_engine(url, out_of_space=True)  # reads (and gc) still work; writes say where space ran out
        try:
            store_id = _store_id(engine, url)
        except DBAPIError:
            raise no_space_error(folder) from exc
    root = Path(artifacts_dir) if artifacts_dir is not None else default_artifacts_dir(url)
    return Store(url, engine=engine, artifacts=ArtifactStore(root / store_id))


def _store_id(engine: Engine, url: str) -> str:
    """The store's id, after checking its schema; the engine is disposed if anything fails."""
    try:
        ensure_schema(engine, url)
        with Session(engine) as session:
            return session.get_one(StorePropertyRow, "store_id").value
    except BaseException:
        engine.dispose()
        raise


class Store(Transactions):
    """Versions, aliases, metrics and publications of mappers.  Build with :func:`open_store`.

    Methods taking ``version`` accept a MapperVersion, a Ref, or a reference string
    (``SRC:DST[:CALIB][@SELECTOR]``, see kvhub.store.refs).  Use as a context manager or call close().
    Its reads and writes are :class:`~kvhub.store.transactions.Transactions` (a lost race is retried).
    """

    def __init__(self, url: str, *, engine: Engine, artifacts: ArtifactStore):
        super().__init__(url, engine=engine)
        self._artifacts = artifacts

    @property
    def artifacts_dir(self) -> Path:
        """This store's artifact root (``.../artifacts/<store id>``)."""
        return self._artifacts.root

    def __repr__(self) -> str:
        return f"Store({display_url(self.url)}, artifacts={self.artifacts_dir})"

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- rows and records ------------------------------------------------------------------------
    def _row(self, session: Session, version: VersionLike) -> VersionRow:
        if isinstance(version, MapperVersion):
            return lookup.version_by_id(session, version.id)
        return lookup.resolve_row(session, version if isinstance(version, Ref) else Ref.parse(version))

    def _record(self, session: Session, row: VersionRow) -> MapperVersion:
        return version_record(row, lookup.aliases_by_version(session, [row.id]).get(row.id, []))

    # ---- registering -----------------------------------------------------------------------------
    def register(
        self, artifact_dir: str | os.PathLike, *, lineage: dict | None = None, preferred_version: int | None = None
    ) -> MapperVersion:
        """Copy an artifact directory into the store and register it as the next version of its triple.

        Creates model and calibration-set rows from mapper.json as needed, records its metrics, and
        keeps ``latest`` on the highest version number.  ``lineage``: any JSON dict (fit options, parent
        version, command line).  An artifact whose tensors (sha256) a version of its triple already holds
        returns that version and changes nothing (see :meth:`registered_as`).  ``preferred_version``: the
        number to take when it is above every number the triple has used or no version holds it (a pull
        keeps the Hub's ``vN``, so an older tag pulled later never becomes ``latest``), else the next.
        Raises ArtifactError / IntegrityError for a malformed or corrupt artifact, ConfigError when the
        triple's versions were fitted on another calibration text (nothing is stored either way).
        """
        _check_json("lineage", lineage)
        metadata = read_metadata(artifact_dir)
        check_storable(metadata)  # before copying: a refusal leaves nothing behind
        self._check_writable()

        def check_text(session: Session) -> None:
            if find_same_tensors(session, metadata) is None:  # identical tensors are that version again
                check_same_text(session, metadata)

        self._read(check_text)
        checked: dict = {}

        def check(copy: Path, hashes: dict[str, str]) -> None:
            try:
                checked["metadata"] = read_checked_metadata(copy, hashes)
            except ArtifactError as exc:  # name the directory the user gave, not the copy that is about to go
                exc.args = (str(exc).replace(str(copy), str(artifact_dir)),)
                raise

        with self._artifacts.writing():
            stored = self._artifacts.put(artifact_dir, check=check)
            version_id = self._write(
                lambda s: insert_version(s, checked["metadata"], stored, lineage, preferred_version)
            )
        version = self.get(version_id)
        if version.artifact_location != stored.location:  # same tensors as an existing version: drop the copy
            try:
                self._collect([stored.location])
            except StoreError as exc:
                log.debug("left the duplicate copy of %s to `kvhub gc` (%s)", version.ref, exc)
            return version
        log.info("registered %s (artifact %s)", version.ref, stored.sha256[:12])
        return version

    def staging(self, *, prefix: str = "staging-"):
        """Context manager: a new empty directory inside the store's ``.tmp``, removed on exit; what a
        killed process leaves there is removed by ``kvhub gc``, never left in /tmp (``kvhub pull``)."""
        self._check_writable()
        return self._artifacts.staging(prefix=prefix)

    def add_metrics(self, version: VersionLike, metrics: list[dict]) -> int:
        """Record measurements {name, value, split?, task?, layer?, n?, seed?}; returns how many."""

        def work(session: Session) -> int:
            row = self._row(session, version)
            session.add_all(metric_row(row.id, metric, kvhub_version=__version__) for metric in metrics)
            return len(metrics)

        return self._write(work)

    def add_publication(self, version: VersionLike, repo_id: str, revision: str | None, commit_sha: str | None) -> dict:
        """Record that ``version`` was pushed to ``repo_id`` at ``revision`` (tag/branch), ``commit_sha``."""

        def work(session: Session) -> dict:
            row = self._row(session, version)
            publication = PublicationRow(version_id=row.id, repo_id=repo_id, revision=revision, commit_sha=commit_sha)
            session.add(publication)
            session.flush()
            return queries.publication_dict(publication)

        return self._write(work)

    # ---- finding ---------------------------------------------------------------------------------
    def get(self, version_id: int) -> MapperVersion:
        """The version with database id ``version_id``."""
        return self._read(lambda s: self._record(s, lookup.version_by_id(s, version_id)))

    def resolve(self, ref: VersionLike) -> MapperVersion:
        """The version a reference names (NotFoundError / AmbiguousError otherwise)."""
        return self._read(lambda s: self._record(s, self._row(s, ref)))

    def reference(self, version: MapperVersion) -> str:
        """The shortest reference naming ``version`` here: short model names if they are unambiguous."""
        try:
            if self.resolve(version.short_ref).id == version.id:
                return version.short_ref
        except (NotFoundError, AmbiguousError):
            pass
        return version.ref

    def find(
        self,
        source: str,
        target: str,
        *,
        calibration: str | None = None,
        version: int | str | None = None,
        alias: str | None = None,
    ) -> MapperVersion:
        """Like :meth:`resolve` with each part given separately (:meth:`Ref.of`)."""
        return self.resolve(Ref.of(source, target, calibration=calibration, version=version, alias=alias))

    def versions(
        self,
        *,
        source: str | None = None,
        target: str | None = None,
        calibration: str | None = None,
        family: str | None = None,
        min_metrics: dict[str, float] | None = None,
    ) -> list[MapperVersion]:
        """Every version matching all filters, ordered by triple then version number.

        source/target match like references (full id or short name, case-insensitive); ``family``
        is the source model's family; ``min_metrics`` {key: threshold} keeps versions with some
        measurement >= threshold of the metric the key names: ``NAME``, or ``NAME@TASK`` for that task
        only.  ConfigError for a name (or task) the store never measured, listing those it has.
        """
        return self._read(
            lambda s: queries.list_versions(
                s, source=source, target=target, calibration=calibration, family=family, min_metrics=min_metrics or {}
            )
        )

    def metrics(self, version: VersionLike, *, names: list[str] | None = None, history: bool = True) -> list[dict]:
        """Measurements of a version {name, value, split, task, layer, n, seed, measured_at, kvhub_version},
        oldest first; ``history=False`` keeps the newest of each (name, split, task, layer)."""
        found = self._read(lambda s: queries.metrics_of(s, self._row(s, version).id, names))
        return found if history else queries.newest_per_key(found)

    def mapper_metrics(self, versions: list[MapperVersion]) -> dict[int, list[dict]]:
        """{version id: measurements of the whole mapper (no layer)}, oldest first, as :meth:`metrics`."""
        return self._read(lambda s: queries.mapper_metrics(s, [v.id for v in versions]))

    def registered_as(self, artifact_dir: str | os.PathLike) -> MapperVersion | None:
        """The version of this artifact's series that holds the same tensors (their sha256), or None.

        :meth:`register` returns that version instead of adding one: identical tensors are one version.
        """
        metadata = read_metadata(artifact_dir)
        check_storable(metadata)  # the series key must exist before it can be looked up
        return self._read(lambda s: self._same_tensors(s, metadata))

    def check_calibration_text(self, *, source: str, target: str, calibration: str, text_sha256: str | None) -> None:
        """ConfigError (naming ``kvhub fit --name``) when the triple holds versions fitted on another
        calibration text than ``text_sha256`` (a calibration set's ``corpus_hash``): what :meth:`register`
        would refuse, asked before a fit spends its forward passes."""
        metadata = {
            "source": {"model_id": source},
            "target": {"model_id": target},
            "calibration": {"name": calibration, "corpus_hash": text_sha256},
        }
        self._read(lambda s: check_same_text(s, metadata))

    def _same_tensors(self, session: Session, metadata: dict) -> MapperVersion | None:
        row = find_same_tensors(session, metadata)
        return None if row is None else self._record(session, row)

    def metric_summary(self, versions: list[MapperVersion], names: list[str]) -> dict[int, dict[str, float]]:
        """{version id: {name: value}} of whole-mapper metrics (no layer), the newest measurement each."""
        return self._read(lambda s: queries.metric_summary(s, [v.id for v in versions], names))

    def publications(self, version: VersionLike) -> list[dict]:
        """Hub publications of a version {repo_id, revision, commit_sha, published_at}, oldest first."""
        return self._read(lambda s: queries.publications_of(s, self._row(s, version).id))

    def describe(self, version: VersionLike, *, history: bool = True) -> dict:
        """Everything about a version (JSON-ready): the record, both model fingerprints, the calibration
        set, metrics (``history=False``: the newest of each, see :meth:`metrics`), publications and the
        artifact path."""
        data = self._read(lambda s: queries.describe_row(s, self._row(s, version)))
        data["artifact_path"] = str(self._artifacts.path(data["artifact_location"]))
        if not history:
            data["metrics"] = queries.newest_per_key(data["metrics"])
        return data

    # ---- artifacts -------------------------------------------------------------------------------
    def artifact_path(self, version: VersionLike) -> Path:
        """Path of a version's artifact directory, verified except for the tensor bytes.

        Every file but the tensor file is re-hashed against the recorded content address; the tensor
        file enters with its recorded sha256, which mapper.json must carry too, and whose bytes
        Mapper.load verifies when it reads them (so they are hashed once per load, not twice).
        Use :meth:`verify` to hash everything.
        """
        record = version if isinstance(version, MapperVersion) else self.resolve(version)
        metadata_path = self._artifacts.path(record.artifact_location) / METADATA_FILE
        tensor_file = trusted_tensor_file(metadata_path, record.tensors_sha256)
        path = self._artifacts.verify(
            record.artifact_location, sha256=record.artifact_sha256, trusted={tensor_file: record.tensors_sha256}
        )
        return path

    def verify(self, version: VersionLike) -> Path:
        """Hash every file of a version's artifact against its content address, then run every check of
        the artifact format on it (kvhub.artifact.read_artifact); returns the path."""
        record = version if isinstance(version, MapperVersion) else self.resolve(version)
        path = self._artifacts.verify(record.artifact_location, sha256=record.artifact_sha256)
        read_artifact(path)
        return path

    def export(self, version: VersionLike, directory: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Copy a version's artifact to ``directory`` (atomically), verifying every byte copied."""
        record = version if isinstance(version, MapperVersion) else self.resolve(version)
        return export_artifact(self.artifact_path(record), directory, record=record, overwrite=overwrite)

    # ---- aliases and removal ---------------------------------------------------------------------
    def tag(self, version: VersionLike, alias: str) -> MapperVersion:
        """Point ``alias`` of the version's triple at it (moving it if set); returns the version."""
        _check_movable(alias)

        def work(session: Session) -> int:
            row = self._row(session, version)
            lock_series(session, row.series_id)
            set_alias(session, row.series_id, alias, row.id)
            return row.id

        return self.get(self._write(work))

    def untag(self, version: VersionLike, alias: str) -> MapperVersion:
        """Remove ``alias`` from a triple; with a version selector, only if it points at that version.

        Returns the version the alias pointed at.
        """
        _check_movable(alias)
        if isinstance(version, MapperVersion):
            ref = Ref(version.source, version.target, version.calibration, version.version)
        else:
            ref = Ref.parse(version) if isinstance(version, str) else version
        return self._write(lambda s: self._untag(s, ref, alias))

    def _untag(self, session: Session, ref: Ref, alias: str) -> MapperVersion:
        series = lookup.find_series(session, ref)
        lock_series(session, series.id)
        pointed = lookup.select_version(session, series, version=None, alias=alias)
        other_version = ref.version is not None and pointed.version != ref.version
        if other_version or ref.alias not in (None, alias):
            wanted = f"v{ref.version}" if ref.version is not None else ref.alias
            triple = f"{series.source_name}:{series.target_name}:{series.calibration_name}"
            raise ConfigError(
                f"{alias!r} points at v{pointed.version}, not {wanted}; to remove it anyway name the triple "
                f"without a selector: `kvhub untag {triple} {alias}`"
            )
        record = self._record(session, pointed)
        session.execute(
            cast(Table, AliasRow.__table__).delete().where(AliasRow.series_id == series.id, AliasRow.name == alias)
        )
        return record

    def remove(self, version: VersionLike, *, force: bool = False) -> MapperVersion:
        """Delete a version (its metrics, publications and aliases go with it) and, unless another
        version shares it, its artifact.  Refuses while an alias other than ``latest`` points at it,
        unless ``force``.  Version numbers are never reused; ``latest`` moves to the newest remaining.
        """
        record = self._write(lambda s: self._remove(s, version, force))
        if not self._artifacts.is_location(record.artifact_location):
            log.warning(
                "removed %s; its database row named the artifact location %r, which is not inside the "
                "store, so no file was deleted",
                record.ref,
                record.artifact_location,
            )
            return record
        try:  # the removal is committed: what follows may only leave work for gc, never fail the removal
            self._collect([record.artifact_location])
        except StoreError as exc:
            log.warning("removed %s; its artifact was left for `kvhub gc` (%s)", record.ref, exc)
        return record

    def _remove(self, session: Session, version: VersionLike, force: bool) -> MapperVersion:
        row = self._row(session, version)
        lock_series(session, row.series_id)  # orders this against a registration moving `latest`
        record = self._record(session, row)
        pinned = [a for a in record.aliases if a != LATEST]
        if pinned and not force:
            names = ", ".join(pinned)
            raise StoreError(
                f"{record.ref} is {names}; move the alias first (`kvhub tag REF@vN {pinned[0]}`), remove it "
                f"(`kvhub untag {record.ref} {pinned[0]}`), or pass --force"
            )
        series_id = row.series_id
        session.delete(row)
        session.flush()
        newest = lookup.newest_version(session, series_id)
        if newest is not None:
            set_alias(session, series_id, LATEST, newest.id)
        return record

    # ---- garbage collection ----------------------------------------------------------------------
    def gc(self, *, dry_run: bool = False) -> GcReport:
        """Remove artifact directories no version references and debris of killed writers.

        Holds the artifact store's exclusive lock, so no registration is between writing its
        artifact and committing its row: a directory without a row is provably unreferenced.  A link at
        ``.tmp`` or ``.lock`` is a StoreError raised before anything is deleted.  Only reads the database:
        ``dry_run`` works on a read-only store, and a store whose file system is full is collected (that
        frees the space); a store read-only for other reasons keeps its artifacts.
        """
        report = GcReport(dry_run=dry_run)
        if not dry_run and out_of_space_folder(self._engine) is None:
            self._check_writable()
        with self._artifacts.collecting(write=not dry_run):
            debris = self._artifacts.temporaries()  # checks .tmp before anything is deleted
            referenced = set(self._read(lambda s: s.scalars(select(VersionRow.artifact_location)).all()))
            stored = set(self._artifacts.locations())
            report.missing = sorted(referenced - stored)
            for location in sorted(stored - referenced):
                report.artifacts.append((location, self._artifacts.size(self._artifacts.path(location))))
                if not dry_run:
                    self._artifacts.remove(location)
            for path in debris:
                report.temporaries.append((path.name, self._artifacts.size(path)))
                if not dry_run:
                    self._artifacts.remove_temporary(path)
        return report

    def _collect(self, locations: list[str]) -> None:
        """Remove these artifacts if no version references them any more."""
        with self._artifacts.collecting(timeout_s=_COLLECT_WAIT_S):
            query = select(VersionRow.artifact_location).where(VersionRow.artifact_location.in_(locations))
            referenced = set(self._read(lambda s: s.scalars(query).all()))
            for location in set(locations) - referenced:
                self._artifacts.remove(location)


def _check_movable(alias: str) -> None:
    if alias == LATEST:
        raise ConfigError("`latest` is maintained by the store (it follows the newest version); use another alias")
    check_alias_name(alias)


def _check_json(what: str, value) -> None:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"{what} must be JSON-serialisable ({exc}); pass plain dicts, lists, strings and numbers"
        ) from exc
