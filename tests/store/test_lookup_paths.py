"""A mapper fitted from local model folders is found by the same paths, however they are written
(ux-3 U3-3): `kvhub fit --src ./models/small` registers the absolute path, and every lookup (list,
show, serve, kvhub.load) resolves a path the same way before matching."""

from __future__ import annotations

import pytest

from tests.fixtures_hub import run
from tests.fixtures_store import make_store_artifact


@pytest.fixture
def fitted_by_path(tmp_path, monkeypatch):
    """A store holding a mapper registered under the absolute paths of fam/src and fam/dst, the working
    directory set to tmp_path so that ./fam/src is the same folder."""
    from kvhub.store import open_store

    for name in ("src", "dst"):
        (tmp_path / "fam" / name).mkdir(parents=True)
    source, target = str((tmp_path / "fam" / "src").resolve()), str((tmp_path / "fam" / "dst").resolve())
    db = str(tmp_path / "store.db")
    with open_store(db) as store:
        store.register(make_store_artifact(tmp_path / "art", source=source, target=target, calibration="notes"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVHUB_HOME", str(tmp_path / "home"))
    return db, source


@pytest.mark.parametrize("spelling", ["./fam/src", "fam/src", "fam/../fam/src/"], ids=["dot", "bare", "dotdot"])
def test_list_finds_the_relative_path(fitted_by_path, spelling):
    db, source = fitted_by_path
    result = run("list", "--src", spelling, "--db", db, "--format", "tsv")
    assert result.exit_code == 0, result.stderr
    assert source in result.stdout


def test_show_by_the_relative_ref(fitted_by_path):
    db, source = fitted_by_path
    result = run("show", "./fam/src:./fam/dst:notes", "--db", db, "--format", "tsv")
    assert result.exit_code == 0, result.stderr
    assert source in result.stdout


def test_load_by_the_relative_paths(fitted_by_path):
    import kvhub

    db, source = fitted_by_path
    mapper = kvhub.load("./fam/src", "./fam/dst", calib="notes", db=db)
    assert mapper.metadata["source"]["model_id"] == source


def test_a_name_that_is_no_path_still_matches_short_names(fitted_by_path):
    db, source = fitted_by_path
    result = run("list", "--src", "src", "--db", db, "--format", "tsv")
    assert result.exit_code == 0 and source in result.stdout


@pytest.mark.parametrize("manifest", [None, {"hf_id": "Qwen/Qwen2.5-Coder-0.5B-Instruct"}], ids=["plain", "fetched"])
def test_lookup_and_fit_name_a_folder_alike(tmp_path, monkeypatch, manifest):
    """The store's rule (it cannot import kvhub.models) is the one fit registers by."""
    import json

    from kvhub.models.loading import MANIFEST, registered_model_id
    from kvhub.store.refs import _registered_id

    folder = tmp_path / "models" / "small"
    folder.mkdir(parents=True)
    if manifest is not None:
        (folder / MANIFEST).write_text(json.dumps(manifest))
    monkeypatch.chdir(tmp_path)
    assert _registered_id("./models/small") == registered_model_id("./models/small")
    assert _registered_id("no/such/folder") is None
