"""A calibration-text clash is refused before any model loads (ux-3 U3-2), the way the review ran it:
model folders given as relative paths (./fam/src), a folder of notes, and --name naming a series fitted
on another text.  The models are config-only directories whose loading fails the test."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvhub.cli.main import main
from kvhub.errors import ConfigError
from tests.fixtures_calib import config_only_model
from tests.fixtures_store import make_store_artifact
from tests.fixtures_fit import tiny_fit_args


def test_text_clash_refused_before_the_models_load(tmp_path, monkeypatch):
    from kvhub.models.loading import registered_model_id
    from kvhub.store import open_store

    monkeypatch.setenv("KVHUB_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KVHUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("KVHUB_DB_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "fam").mkdir()
    for name in ("src", "dst"):
        config_only_model(tmp_path / "fam" / name, monkeypatch)
    artifact = make_store_artifact(
        tmp_path / "v1",
        source=registered_model_id("./fam/src"),
        target=registered_model_id("./fam/dst"),
        calibration="support-notes",
    )
    metadata = json.loads((artifact / "mapper.json").read_text())
    metadata["calibration"]["corpus_hash"] = "f" * 64  # fitted on another text
    (artifact / "mapper.json").write_text(json.dumps(metadata))
    with open_store() as store:
        store.register(artifact)
    notes = tmp_path / "notes"
    notes.mkdir()
    for i in range(40):
        (notes / f"{i:02d}.txt").write_text(f"note {i} " * 60, encoding="utf-8")

    result = CliRunner().invoke(
        main,
        tiny_fit_args(
            "./fam/src", "./fam/dst", calib="./notes", samples=8, seq_len=32, stride=None, name="support-notes"
        ),
    )
    assert result.exit_code == ConfigError.exit_code, result.output  # not config_only_model's AssertionError
    assert "another text" in result.output and "--name support-notes-2" in result.output
