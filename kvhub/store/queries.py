"""Read-side queries of the store that hand back plain, JSON-ready data (lists and dicts)."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from kvhub.errors import ConfigError
from kvhub.store import lookup
from kvhub.store.records import MapperVersion, as_utc, version_record
from kvhub.store.refs import match_calibration_names, match_model_names
from kvhub.store.tables import CalibrationSetRow, MetricRow, ModelRow, PublicationRow, SeriesRow, VersionRow

_MODEL_FIELDS = (
    "name",
    "revision",
    "model_type",
    "family",
    "config_hash",
    "tokenizer_hash",
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "rope",
    "layer_types",
)


def list_versions(
    session: Session,
    *,
    source: str | None,
    target: str | None,
    calibration: str | None,
    family: str | None,
    min_metrics: dict[str, float],
) -> list[MapperVersion]:
    """Versions matching every filter (see Store.versions), by triple then version number."""
    query = lookup.versions_query().join(VersionRow.series)
    series = session.scalars(select(SeriesRow)).all()
    if source is not None:
        query = query.where(SeriesRow.source_name.in_(match_model_names(source, [s.source_name for s in series])))
    if target is not None:
        query = query.where(SeriesRow.target_name.in_(match_model_names(target, [s.target_name for s in series])))
    if calibration is not None:
        names = match_calibration_names(calibration, [s.calibration_name for s in series])
        query = query.where(SeriesRow.calibration_name.in_(names))
    if family is not None:
        query = query.where(VersionRow.source_model.has(func.lower(ModelRow.family) == family.lower()))
    for key, threshold in min_metrics.items():
        name, task = check_metric_key(session, key)
        passing = select(MetricRow.version_id).where(MetricRow.name == name, MetricRow.value >= float(threshold))
        if task is not None:
            passing = passing.where(MetricRow.task == task)
        query = query.where(VersionRow.id.in_(passing))
    query = query.order_by(SeriesRow.source_name, SeriesRow.target_name, SeriesRow.calibration_name, VersionRow.version)
    rows = session.scalars(query).all()
    aliases = lookup.aliases_by_version(session, [row.id for row in rows])
    return [version_record(row, aliases.get(row.id, [])) for row in rows]


def check_metric_key(session: Session, key: str) -> tuple[str, str | None]:
    """``NAME`` or ``NAME@TASK`` (the task may hold a variant: ``retention@hellaswag@exact_prefix4``) ->
    (name, task or None); ConfigError naming what the store measured when it never measured that."""
    name, _, task = key.partition("@")
    known = sorted(session.scalars(select(MetricRow.name).distinct()).all())
    if name not in known:
        raise ConfigError(
            f"--min-metric {key!r}: no version has a metric {name!r} ({_shown('metrics', known)}); "
            "`kvhub show REF` lists a version's metrics"
        )
    if not task:
        return name, None
    tasks = sorted(t for t in session.scalars(select(MetricRow.task).where(MetricRow.name == name).distinct()) if t)
    if task not in tasks:
        raise ConfigError(
            f"--min-metric {key!r}: {name!r} was never measured on task {task!r} "
            f"({_shown('tasks', tasks)}); write NAME@TASK=VALUE with one of those"
        )
    return name, task


def _shown(what: str, names: list[str]) -> str:
    if not names:
        return f"the store has no {what} yet"
    return f"{what} in the store: " + ", ".join(names[:30]) + (", ..." if len(names) > 30 else "")


def newest_per_key(metrics: list[dict]) -> list[dict]:
    """The newest measurement of each (name, split, task, layer) in ``metrics`` (oldest first in, and
    out): a rerun of an evaluation replaces its earlier values in the view, not in the store."""
    newest: dict[tuple, dict] = {}
    for metric in metrics:
        key = (metric["name"], metric["split"], metric["task"], metric["layer"])
        newest.pop(key, None)  # re-insert: the dict stays in measurement order
        newest[key] = metric
    return list(newest.values())


def metrics_of(session: Session, version_id: int, names: list[str] | None) -> list[dict]:
    """Measurements of one version, oldest first."""
    query = select(MetricRow).where(MetricRow.version_id == version_id)
    if names is not None:
        query = query.where(MetricRow.name.in_(names))
    return [metric_dict(m) for m in session.scalars(query.order_by(MetricRow.measured_at, MetricRow.id))]


def mapper_metrics(session: Session, version_ids: list[int]) -> dict[int, list[dict]]:
    """{version id: [metric dict]} of whole-mapper measurements (no layer), oldest first."""
    query = (
        select(MetricRow)
        .where(MetricRow.version_id.in_(version_ids), MetricRow.layer.is_(None))
        .order_by(MetricRow.measured_at, MetricRow.id)
    )
    found: dict[int, list[dict]] = {}
    for row in session.scalars(query):
        found.setdefault(row.version_id, []).append(metric_dict(row))
    return found


def metric_summary(session: Session, version_ids: list[int], names: list[str]) -> dict[int, dict[str, float]]:
    """{version id: {name: value}} of whole-mapper metrics (no layer); the newest measurement wins."""
    query = (
        select(MetricRow)
        .where(MetricRow.version_id.in_(version_ids), MetricRow.name.in_(names), MetricRow.layer.is_(None))
        .order_by(MetricRow.measured_at, MetricRow.id)
    )
    summary: dict[int, dict[str, float]] = {}
    for row in session.scalars(query):
        summary.setdefault(row.version_id, {})[row.name] = row.value
    return summary


def publications_of(session: Session, version_id: int) -> list[dict]:
    """Hub publications of one version, oldest first."""
    query = select(PublicationRow).where(PublicationRow.version_id == version_id).order_by(PublicationRow.id)
    return [publication_dict(p) for p in session.scalars(query)]


def describe_row(session: Session, row: VersionRow) -> dict:
    """The version record plus models, calibration set, metrics and publications, JSON-ready."""
    aliases = lookup.aliases_by_version(session, [row.id]).get(row.id, [])
    data = version_record(row, aliases).to_dict()
    data["source_model"] = {name: getattr(row.source_model, name) for name in _MODEL_FIELDS}
    data["target_model"] = {name: getattr(row.target_model, name) for name in _MODEL_FIELDS}
    data["calibration_set"] = calibration_dict(row.calibration_set)
    data["metrics"] = metrics_of(session, row.id, None)
    data["publications"] = publications_of(session, row.id)
    return data


def metric_dict(row: MetricRow) -> dict:
    return {
        "name": row.name,
        "value": row.value,
        "split": row.split,
        "task": row.task,
        "layer": row.layer,
        "n": row.n,
        "seed": row.seed,
        "measured_at": as_utc(row.measured_at).isoformat(),
        "kvhub_version": row.kvhub_version,
    }


def publication_dict(row: PublicationRow) -> dict:
    return {
        "repo_id": row.repo_id,
        "revision": row.revision,
        "commit_sha": row.commit_sha,
        "published_at": as_utc(row.published_at).isoformat(),
    }


def calibration_dict(row: CalibrationSetRow) -> dict:
    return {
        "name": row.name,
        "version": row.version,
        "content_hash": row.content_hash,
        "tokens": row.tokens,
        "recipe": row.recipe,
    }
