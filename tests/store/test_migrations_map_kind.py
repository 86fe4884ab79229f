"""Migration 0003 (map kinds) on SQLite and PostgreSQL: an old store's versions become ridge maps, an mlp
version records its kind, width, depth and losses, and a downgrade drops the columns but keeps the rows."""

from __future__ import annotations

import json
from pathlib import Path

import sqlalchemy as sa
import torch

from kvhub.artifact import map_prefix, tensor_name
from kvhub.artifact.kinds import mlp_part
from kvhub.core.mapper import Mapper
from kvhub.store import migrate, open_store
from kvhub.store.engine import make_engine
from tests.fixtures_store import make_store_artifact
from tests.store.test_migrations import FIRST, _fill_first_revision, _store_id

BEFORE = "0002_hub_publications"


def mlp_artifact(directory: Path, *, seed: int = 0, width: int = 4, depth: int = 2) -> Path:
    """A small random mapper of kind mlp (make_store_artifact's maps plus residual MLPs)."""
    base = Mapper.load(make_store_artifact(directory.parent / f"{directory.name}-base", seed=seed))
    generator = torch.Generator().manual_seed(seed)
    tensors = dict(base.tensors)
    d_in, d_out = tensors["k.0.weight"].shape
    widths = [d_in] + [width] * depth + [d_out]
    for layer in base.layers:
        for kind in "kv":
            prefix = map_prefix(kind, layer["target"])
            for i in range(depth + 1):
                tensors[tensor_name(prefix, mlp_part(i, "weight"))] = torch.randn(
                    widths[i], widths[i + 1], generator=generator
                )
                tensors[tensor_name(prefix, mlp_part(i, "bias"))] = torch.zeros(widths[i + 1])
    count = len(base.layers)
    losses = {kind: {"train": [0.5] * count, "heldout": [0.75] * count} for kind in "kv"}
    metadata = {
        **base.metadata,
        "kind": "mlp",
        "mlp": {"width": width, "depth": depth, "activation": "gelu", "losses": losses},
    }
    return Mapper(tensors, metadata).save(directory)


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
