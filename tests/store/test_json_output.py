"""``--format json`` of the store commands is strict JSON whatever a row holds: NaN or an infinity in a column
(a row an older kvhub registered before it checked R^2 and the MLP losses, or a row edited by hand) prints as
null, never as the bare ``NaN`` / ``Infinity`` no JSON parser but Python's accepts."""

from __future__ import annotations

import json
import sqlite3

import pytest
from click.testing import CliRunner

from kvhub.cli.main import main
from kvhub.store import open_store
from tests.fixtures_store import make_store_artifact


def _strict(text: str):
    """json.loads refusing NaN / Infinity / -Infinity."""

    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def store_with_nan(tmp_path):
    """A SQLite store with one version whose selected layers hold NaN and Infinity R^2 (written behind kvhub)."""
    db = tmp_path / "kvhub.db"
    with open_store(db) as store:
        version = store.register(make_store_artifact(tmp_path / "a", seed=1))
    with sqlite3.connect(db) as connection:
        (layers,) = connection.execute("SELECT selected_layers FROM mapper_versions").fetchone()
        layers = json.loads(layers)
        layers[0].update(r2_k=float("nan"), r2_v=float("inf"))
        connection.execute("UPDATE mapper_versions SET selected_layers = ?", (json.dumps(layers),))
    return db, version.ref


@pytest.mark.parametrize("command", [["list"], ["show", "REF"], ["show", "REF", "--layers"]])
def test_json_output_writes_non_finite_numbers_as_null(store_with_nan, command):
    """Planted bugs caught: echo_json passing NaN through (json.dumps writes ``NaN`` by default); a command
    printing its JSON without echo_json."""
    db, ref = store_with_nan
    args = [ref if word == "REF" else word for word in command]
    result = CliRunner().invoke(main, [*args, "--format", "json", "--db", str(db)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    data = _strict(result.stdout)
    version = data[0] if isinstance(data, list) else data
    first = version["selected_layers"][0]
    assert first["r2_k"] is None and first["r2_v"] is None


def test_a_non_finite_metric_is_skipped_with_one_warning(tmp_path, caplog):
    """Planted bug caught: "not storing metric ... (not a finite number)" printed four times per value (an import
    reads mapper.json's metrics before the copy, after it, and twice when inserting)."""
    artifact = make_store_artifact(tmp_path / "a", seed=3, metrics={"heldout_r2_k_mean": float("inf"), "loss": 0.5})
    with caplog.at_level("WARNING", logger="kvhub"):
        result = CliRunner().invoke(main, ["import", str(artifact), "--db", str(tmp_path / "kvhub.db")])
    assert result.exit_code == 0, result.output
    assert caplog.text.count("not storing metric heldout_r2_k_mean=inf") == 1
    listed = CliRunner().invoke(main, ["list", "--format", "json", "--db", str(tmp_path / "kvhub.db")])
    names = {m["name"] for m in _strict(listed.stdout)[0]["metrics"]}
    assert "loss" in names and "heldout_r2_k_mean" not in names
