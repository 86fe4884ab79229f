"""Looking references up: the rows a reference names (which triple, then which version of it).

A miss raises :class:`NotFoundError` (the Hub fallback of kvhub.api catches exactly that); a name that
designates several triples raises :class:`AmbiguousError` listing them.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session, joinedload

from kvhub.errors import AmbiguousError, NotFoundError
from kvhub.store.refs import LATEST, PRODUCTION, Ref, match_calibration_names, match_model_names
from kvhub.store.tables import AliasRow, SeriesRow, VersionRow

_NEXT_STEP = "fit one with `kvhub fit`, import one with `kvhub import DIR`, or see what exists with `kvhub list`"


def live_series(session: Session) -> list[SeriesRow]:
    """Every triple that holds a version: one whose versions were all removed names nothing."""
    holds = select(VersionRow.id).where(VersionRow.series_id == SeriesRow.id).exists()
    return list(session.scalars(select(SeriesRow).where(holds)).all())


def find_series(session: Session, ref: Ref) -> SeriesRow:
    """The one triple ``ref`` names (its selector is ignored here)."""
    series = live_series(session)
    series, sources = _narrow(
        series,
        "source_name",
        match_model_names(ref.source, [s.source_name for s in series]),
        miss=f"no mapper from model {ref.source!r} in the store",
        what="sources",
    )
    series, targets = _narrow(
        series,
        "target_name",
        match_model_names(ref.target, [s.target_name for s in series]),
        miss=f"no mapper from {_one_of(sources)} to {ref.target!r}",
        what="targets",
    )
    if ref.calibration is not None:
        series, _ = _narrow(
            series,
            "calibration_name",
            match_calibration_names(ref.calibration, [s.calibration_name for s in series]),
            miss=f"no mapper from {_one_of(sources)} to {_one_of(targets)} fitted on calibration set "
            f"{ref.calibration!r}",
            what="calibration sets",
        )
    if len(series) > 1:
        raise _ambiguity(ref, series)
    return series[0]


def _narrow(series: list[SeriesRow], column: str, matches: list[str], *, miss: str, what: str):
    """(the series whose ``column`` is one of ``matches``, ``matches``); when there is none, NotFoundError
    saying ``miss``, listing the ``what`` the store has and the next step."""
    if not matches:
        known = sorted({getattr(s, column) for s in series})
        raise NotFoundError(f"{miss} ({_listing(what, known)}); {_NEXT_STEP}")
    return [s for s in series if getattr(s, column) in matches], matches


def _ambiguity(ref: Ref, series: list[SeriesRow]) -> AmbiguousError:
    pairs = {(s.source_name, s.target_name) for s in series}
    if len(pairs) == 1 and ref.calibration is None:
        calibrations = sorted(s.calibration_name for s in series)
        first, names = calibrations[0], ", ".join(calibrations)
        return AmbiguousError(
            f"{ref.source}:{ref.target} has mappers for several calibration sets ({names}); name one, e.g. "
            f"{ref.source}:{ref.target}:{first}"
        )
    triples = "\n  ".join(sorted(f"{s.source_name}:{s.target_name}:{s.calibration_name}" for s in series))
    return AmbiguousError(f"{str(ref)!r} matches several mappers; use full model ids:\n  {triples}")


def _listing(what: str, names: list[str]) -> str:
    if not names:
        return "the store is empty"
    shown = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
    return f"{what} in the store: {shown}"


def _one_of(names: list[str]) -> str:
    return names[0] if len(names) == 1 else "/".join(names)


def select_version(session: Session, series: SeriesRow, *, version: int | None, alias: str | None) -> VersionRow:
    """Version ``version``, or the one alias ``alias`` points at, else ``production``, else ``latest``."""
    where = f"{series.source_name}:{series.target_name}:{series.calibration_name}"
    if version is not None:
        row = session.scalar(versions_query().where(VersionRow.series_id == series.id, VersionRow.version == version))
        if row is None:
            raise NotFoundError(
                f"{where} has no version v{version} ({_version_listing(session, series)}); "
                f"name one of those, or @latest for the newest (`kvhub list` shows them)"
            )
        return row
    for name in [alias] if alias is not None else [PRODUCTION, LATEST]:
        row = session.scalar(
            versions_query()
            .join(AliasRow, AliasRow.version_id == VersionRow.id)
            .where(AliasRow.series_id == series.id, AliasRow.name == name)
        )
        if row is not None:
            return row
    if alias is not None:
        raise NotFoundError(f"{where} has no alias {alias!r}; set it with `kvhub tag {where}@vN {alias}`")
    raise NotFoundError(f"{where} has no versions left (all were removed); {_NEXT_STEP}")


def _version_listing(session: Session, series: SeriesRow) -> str:
    numbers = session.scalars(
        select(VersionRow.version).where(VersionRow.series_id == series.id).order_by(VersionRow.version)
    ).all()
    return "versions: " + ", ".join(f"v{n}" for n in numbers) if numbers else "no versions left"


def versions_query():
    """SELECT of version rows with their series, source model and calibration set loaded."""
    return select(VersionRow).options(
        joinedload(VersionRow.series), joinedload(VersionRow.source_model), joinedload(VersionRow.calibration_set)
    )


def resolve_row(session: Session, ref: Ref) -> VersionRow:
    """The version row ``ref`` names."""
    return select_version(session, find_series(session, ref), version=ref.version, alias=ref.alias)


def version_by_id(session: Session, version_id: int) -> VersionRow:
    row = session.scalar(versions_query().where(VersionRow.id == version_id))
    if row is None:
        raise NotFoundError(f"mapper version id {version_id} is not in the store (removed?); see `kvhub list`")
    return row


def aliases_by_version(session: Session, version_ids) -> dict[int, list[str]]:
    """{version id: [alias names]} for the given versions."""
    rows = session.execute(
        select(AliasRow.version_id, AliasRow.name).where(AliasRow.version_id.in_(list(version_ids)))
    ).all()
    found: dict[int, list[str]] = {}
    for version_id, name in rows:
        found.setdefault(version_id, []).append(name)
    return found


def newest_version(session: Session, series_id: int) -> VersionRow | None:
    """The highest-numbered remaining version of a series."""
    newest = select(func.max(VersionRow.version)).where(VersionRow.series_id == series_id).scalar_subquery()
    return session.scalar(select(VersionRow).where(VersionRow.series_id == series_id, VersionRow.version == newest))
