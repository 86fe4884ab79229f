"""Artifact format version 3: written whenever target_mean tensors are stored, so an older kvhub says
"upgrade kvhub" instead of calling the artifact corrupt; this kvhub reads 1, 2 and 3."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvhub.artifact import FORMAT_VERSION, SUPPORTED_FORMAT_VERSIONS, format_version_of, map_prefix, read_artifact
from kvhub.core.mapper import Mapper
from tests.fixtures_store import load_with_old_kvhub, make_store_artifact

ROOT = Path(__file__).resolve().parents[2]
BEFORE_V3 = "29b55c1"  # kvhub 0.1: reads format versions 1 and 2, and no target_mean tensors


def _with_means(directory: Path, *, seed: int = 1) -> Path:
    base = Mapper.load(make_store_artifact(directory.parent / f"{directory.name}-base", seed=seed))
    tensors = dict(base.tensors)
    for m in range(base.target["num_layers"]):
        for kind in ("k", "v"):
            tensors[f"{map_prefix(kind, m)}.target_mean"] = torch.randn(tensors[f"{kind}.{m}.bias"].shape)
    return Mapper(tensors, base.metadata).save(directory)


def test_target_means_declare_format_3_and_read_back(tmp_path):
    assert FORMAT_VERSION == 4 and SUPPORTED_FORMAT_VERSIONS == (
        1,
        2,
        3,
        4,
    )  # 4: map kinds (tests/core/test_mlp_map.py)
    artifact = _with_means(tmp_path / "m")
    assert read_artifact(artifact)["format_version"] == 3
    loaded = Mapper.load(artifact)
    assert loaded.format_version() == 3 and "k.0.target_mean" in loaded.tensors
    plain = Mapper.load(make_store_artifact(tmp_path / "plain", seed=2))
    assert plain.metadata["format_version"] == 1 == format_version_of({"k.0.weight": (4, 4), "k.0.bias": (4,)})
    assert format_version_of({"k.0.weight_a": (4, 2), "k.0.weight_b": (2, 4), "k.0.bias": (4,)}) == 2


def test_artifacts_written_before_version_3_with_target_means_still_read(tmp_path):
    artifact = _with_means(tmp_path / "m")
    path = artifact / "mapper.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), format_version=1)))  # as kvhub wrote them then
    assert read_artifact(artifact)["format_version"] == 1
    assert "v.2.target_mean" in Mapper.load(artifact).tensors


@pytest.mark.slow
def test_kvhub_before_version_3_says_upgrade(tmp_path):
    done = load_with_old_kvhub(BEFORE_V3, _with_means(tmp_path / "m"), tmp_path)
    assert done.returncode != 0
    assert "FormatVersionError" in done.stderr and "format version 3" in done.stderr and "upgrade" in done.stderr
