"""Migration 0003 (map kinds) on SQLite and PostgreSQL: an old store's versions become ridge maps, an mlp
version records its kind, width, depth and losses, and a downgrade drops the columns but keeps the rows."""

from __future__ import annotations

import json

import sqlalchemy as sa

from kvhub.core.mapper import Mapper
from kvhub.store import migrate, open_store
from kvhub.store.engine import make_engine
from tests.fixtures_store import mlp_artifact
from tests.store.test_migrations import FIRST, _fill_first_revision, _store_id

BEFORE = "0002_hub_publications"


def _columns(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return {c["name"] for c in sa.inspect(engine).get_columns("mapper_versions")}
    finally:
        engine.dispose()


def test_an_old_store_upgrades_to_ridge_versions_and_takes_mlp_ones(db_url, tmp_path, artifact_factory):
    from kvhub.store.artifacts import ArtifactStore

    migrate.upgrade(db_url, revision=FIRST)
    artifact = artifact_factory(seed=1)
    metadata = json.loads((artifact / "mapper.json").read_text())
    artifacts = ArtifactStore(tmp_path / "artifacts" / _store_id(db_url))
    with artifacts.writing():
        stored = artifacts.put(artifact)
    _fill_first_revision(db_url, stored, metadata)
    migrate.upgrade(db_url, revision=BEFORE)
    assert "map_kind" not in _columns(db_url)
    migrate.upgrade(db_url)
    with open_store(db_url, artifacts_dir=tmp_path / "artifacts") as store:
        old = store.resolve("tiny-coder-0.5b-instruct:tiny-coder-1.5b-instruct@v3")
        assert (old.map_kind, old.mlp_width, old.mlp_depth, old.mlp_losses) == ("ridge", None, None, None)
        new = store.register(mlp_artifact(tmp_path / "mlp", seed=2, width=4, depth=2))
        again = store.resolve(new.ref)
        assert (again.map_kind, again.mlp_width, again.mlp_depth) == ("mlp", 4, 2)
        assert again.mlp_losses["v"]["heldout"] == [0.75] * 3 and again.to_dict()["map_kind"] == "mlp"
        assert Mapper.load(store.artifact_path(again)).kind.name == "mlp"


def test_downgrade_drops_the_kind_columns_and_keeps_the_versions(db_url, tmp_path):
    with open_store(db_url, artifacts_dir=tmp_path / "a") as store:
        store.register(mlp_artifact(tmp_path / "mlp", seed=3))
    migrate.downgrade(db_url, revision=BEFORE)
    assert not {"map_kind", "mlp_width", "mlp_depth", "mlp_losses"} & _columns(db_url)
    engine = make_engine(db_url)
    with engine.connect() as connection:
        assert connection.exec_driver_sql("SELECT count(*) FROM mapper_versions").scalar() == 1
    engine.dispose()
    migrate.upgrade(db_url)
    with open_store(db_url, artifacts_dir=tmp_path / "a") as store:
        [version] = store.versions()
        assert version.map_kind == "ridge"  # what the upgrade assumes of rows it did not see written
