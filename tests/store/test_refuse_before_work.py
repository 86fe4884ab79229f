"""A fit the store would refuse is refused before any model loads, and a name that would mislead
(a built-in set's name over other text, a name no command can quote) never enters the store
(reliability-3 R3-6, R3-12).  Models here are config-only directories whose loading fails the test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvhub.cli.main import main
from kvhub.errors import ConfigError, InvalidArtifactError
from tests.fixtures_calib import config_only_model
from tests.fixtures_store import SRC_ID, make_store_artifact
from tests.fixtures_fit import tiny_fit_args


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KVHUB_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KVHUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("KVHUB_DB_URL", raising=False)
    monkeypatch.delenv("KVHUB_ARTIFACTS", raising=False)
    return tmp_path / "home"


@pytest.fixture
def models(tmp_path, monkeypatch) -> tuple[Path, Path]:
    return config_only_model(tmp_path / "src", monkeypatch), config_only_model(tmp_path / "dst", monkeypatch)


def _text(path: Path, word: str) -> Path:
    path.write_text("\n\n".join(f"{word}{i} " * 40 for i in range(60)), encoding="utf-8")
    return path


def _register(tmp_path, models, *, name: str, text_sha256: str) -> None:
    from kvhub.models.loading import registered_model_id
    from kvhub.store import open_store

    src, dst = (registered_model_id(str(m)) for m in models)
    path = make_store_artifact(tmp_path / f"artifact-{name}", source=src, target=dst, calibration=name)
    metadata = json.loads((path / "mapper.json").read_text())
    metadata["calibration"]["corpus_hash"] = text_sha256
    (path / "mapper.json").write_text(json.dumps(metadata))
    with open_store() as store:
        store.register(path)


def _fit(models, *args):
    src, dst = models
    return CliRunner().invoke(
        main,
        tiny_fit_args(src, dst, *args, samples=8, seq_len=32, stride=None),
    )


def test_a_name_holding_another_text_is_refused_before_loading(home, tmp_path, models):
    _register(tmp_path, models, name="notes", text_sha256="a" * 64)
    out = tmp_path / "out"
    result = _fit(models, "--calib", _text(tmp_path / "b.txt", "beta"), "--name", "notes", "--out", out)
    assert result.exit_code == ConfigError.exit_code, result.output  # not the AssertionError of a model load
    assert "another text" in result.output and "--name notes-2" in result.output
    assert not out.exists()


def test_the_same_text_or_a_new_name_goes_on_to_load_the_models(home, tmp_path, models):
    """The check refuses only the clash: past it, the (patched) model load is what stops the fit."""
    from kvhub.calib.calibration_set import read_documents
    from kvhub.calib.packing import corpus_digest
    from kvhub.calib.recipe import recipe_from_spec

    text = _text(tmp_path / "a.txt", "alpha")
    _register(tmp_path, models, name="notes", text_sha256=corpus_digest(read_documents(recipe_from_spec(str(text)))[0]))
    for name in ("notes", "fresh"):
        result = _fit(models, "--calib", text, "--name", name)
        assert isinstance(result.exception, AssertionError), result.output  # reached the model load


def test_out_is_written_before_registering(home, tmp_path, tiny_model_dirs, monkeypatch):
    """A registration refused after the fit (a race with another fit) must not lose the fitted mapper."""
    import kvhub.cli.fit_cmd

    def refuse(artifact, db):
        raise ConfigError("refused for the test")

    monkeypatch.setattr(kvhub.cli.fit_cmd, "_register", refuse)
    out = tmp_path / "out"
    result = _fit(
        tiny_model_dirs,
        "--calib",
        _text(tmp_path / "a.txt", "alpha"),
        "--stride",
        "1",
        "--lambda",
        "1e-6",
        "--out",
        out,
    )
    assert result.exit_code == ConfigError.exit_code, result.output
    assert (out / "mapper.json").is_file()


@pytest.mark.parametrize("name", ["legal-docs", "code", "mixed"])
def test_a_built_in_sets_name_over_other_text_is_refused(home, tmp_path, models, name):
    result = _fit(models, "--calib", _text(tmp_path / "notes.txt", "gamma"), "--name", name)
    assert result.exit_code == ConfigError.exit_code, result.output
    assert "built-in calibration set" in result.output and f"--name {name}-own" in result.output


@pytest.mark.parametrize(
    "name",
    ["my notes; $(id)", "sp ace", 'q"uote', "a:b", "-dash", ""],
    ids=["shell", "space", "quote", "colon", "dash", "empty"],
)
def test_import_refuses_names_fit_refuses(home, tmp_path, name):
    path = make_store_artifact(tmp_path / "artifact", calibration="ok")
    metadata = json.loads((path / "mapper.json").read_text())
    metadata["calibration"]["name"] = name
    (path / "mapper.json").write_text(json.dumps(metadata))
    result = CliRunner().invoke(main, ["import", str(path)])
    assert result.exit_code == InvalidArtifactError.exit_code, result.output
    assert "calibration.name" in result.output and "Traceback" not in result.output
    assert SRC_ID not in CliRunner().invoke(main, ["list", "--json"]).output
