"""Advice names what exists where it is read (ux-3 U3-12): a reference in a message for every command
(show, tag, rm and export have no --calib), Python keywords in errors raised to Python, kvhub's flags in
the CLI's."""

from __future__ import annotations

import pytest

from kvhub.errors import AmbiguousError, ArtifactError, ConfigError
from kvhub.fitting.options import FitOptions
from kvhub.store import open_store
from tests.fixtures_hub import run
from tests.fixtures_store import make_store_artifact


@pytest.fixture
def two_series(tmp_path):
    db = str(tmp_path / "store.db")
    with open_store(db) as store:
        for calibration in ("code", "notes"):
            store.register(make_store_artifact(tmp_path / calibration, calibration=calibration))
    return db


@pytest.mark.parametrize("command", ["show", "rm", "export"], ids=["show", "rm", "export"])
def test_ambiguity_names_a_reference_not_a_missing_option(two_series, tmp_path, command):
    args = {"export": [str(tmp_path / "out")]}.get(command, [])
    result = run(command, "Tiny-Coder-0.5B-Instruct:Tiny-Coder-1.5B-Instruct", *args, "--db", two_series)
    assert result.exit_code == AmbiguousError.exit_code, result.output
    assert "--calib" not in result.stderr and "Tiny-Coder-1.5B-Instruct:code" in result.stderr


def test_load_names_no_cli_option(two_series):
    import kvhub

    with pytest.raises(AmbiguousError) as refused:
        kvhub.load("Tiny-Coder-0.5B-Instruct", "Tiny-Coder-1.5B-Instruct", db=two_series)
    assert "--calib" not in str(refused.value)


def test_python_errors_name_python_keywords(tmp_path):
    from kvhub.api import Mapper

    mapper = Mapper.load(make_store_artifact(tmp_path / "a"))
    with pytest.raises(ArtifactError) as refused:
        mapper.save(tmp_path / "a")
    assert "overwrite=True" in str(refused.value) and "--force" not in str(refused.value)
    with pytest.raises(ConfigError) as refused:
        FitOptions(ridge_lambda=-1.0)
    assert str(refused.value).startswith("ridge_lambda=-1.0")


def test_export_says_force(two_series, tmp_path):
    (tmp_path / "out").mkdir()
    result = run(
        "export", "Tiny-Coder-0.5B-Instruct:Tiny-Coder-1.5B-Instruct:code", str(tmp_path / "out"), "--db", two_series
    )
    assert result.exit_code == ConfigError.exit_code and "--force" in result.stderr
    assert "overwrite=True" not in result.stderr
