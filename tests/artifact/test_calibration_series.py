"""mapper.json's ``calibration.series`` (the name the store files a mapper under, ``kvhub fit --name``) beside
the calibration set's own ``calibration.name``; files written before the field, whose ``name`` held the series,
still read and register the same way.  Planted bugs caught: a reader of the series that reads ``name`` (a
``--name`` fit filed under the set's name); the fallback to ``name`` dropped (older artifacts unregistrable);
a series field that is not text accepted."""

from __future__ import annotations

import json

import pytest

from kvhub.artifact.metadata import calibration_series, check_metadata
from kvhub.errors import InvalidArtifactError
from tests.fixtures_store import make_store_artifact


def test_the_series_is_its_own_field_and_older_files_read_their_name():
    assert calibration_series({"name": "notes", "series": "support-notes"}) == "support-notes"
    assert calibration_series({"name": "support-notes"}) == "support-notes"  # written before the field
    assert calibration_series({}) is None and calibration_series(None) is None


def _with_calibration(path, **fields):
    metadata = json.loads((path / "mapper.json").read_text())
    metadata["calibration"].update(fields)
    (path / "mapper.json").write_text(json.dumps(metadata))
    return metadata


def test_a_series_that_is_not_text_is_refused(tmp_path):
    metadata = _with_calibration(make_store_artifact(tmp_path / "a"), series=["support-notes"])
    with pytest.raises(InvalidArtifactError, match="calibration.series"):
        check_metadata(metadata, where="mapper.json")


def test_the_store_files_a_version_under_its_series_and_older_files_under_their_name(tmp_path, monkeypatch):
    from kvhub.store import open_store

    monkeypatch.setenv("KVHUB_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KVHUB_DB_URL", raising=False)
    new = make_store_artifact(tmp_path / "new", calibration="notes", seed=1)
    _with_calibration(new, series="support-notes")
    old = make_store_artifact(tmp_path / "old", calibration="support-notes", seed=2)  # name held the series
    with open_store() as store:
        references = [store.reference(store.register(path)) for path in (new, old)]
    assert references[0].endswith(":support-notes@v1") and references[1].endswith(":support-notes@v2")


def test_a_bad_series_name_is_refused_by_its_field(tmp_path, monkeypatch):
    from kvhub.store import open_store

    monkeypatch.setenv("KVHUB_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KVHUB_DB_URL", raising=False)
    path = make_store_artifact(tmp_path / "a", calibration="notes")
    _with_calibration(path, series="a:b")
    with open_store() as store, pytest.raises(InvalidArtifactError, match="calibration.series"):
        store.register(path)
