"""One name for one thing across commands (ux-3 U3-27): an output directory or file is --out everywhere
(eval keeps lm-eval's --output-path, export its DIR argument), a Hub repository --repo everywhere (pull
keeps its REPO argument, serve its --hub-repo)."""

from __future__ import annotations

import json

import pytest

from kvhub.cli.main import main
from kvhub.store import open_store
from tests.fixtures_hub import register, run
from tests.fixtures_store import make_store_artifact


@pytest.mark.parametrize(
    "command, option",
    [
        ("eval", "--out"),
        ("eval", "--output-path"),
        ("eval-serve", "--out"),
        ("fit", "--out"),
        ("report", "--out"),
        ("export", "--out"),
        ("push", "--repo"),
        ("pull", "--repo"),
        ("serve", "--repo"),
        ("serve", "--hub-repo"),
    ],
    ids=lambda v: f"U3_27_{v}",
)
def test_each_command_takes_the_common_name(command, option):
    opts = {opt for param in main.commands[command].params for opt in getattr(param, "opts", [])}
    assert option in opts


def test_export_out(tmp_path):
    db = str(tmp_path / "store.db")
    with open_store(db) as store:
        ref = store.register(make_store_artifact(tmp_path / "a")).ref
    result = run("export", ref, "--out", str(tmp_path / "exported"), "--db", db)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "exported" / "mapper.json").is_file()
    neither = run("export", ref, "--db", db)
    assert neither.exit_code == 2 and "DIRECTORY or --out" in neither.stderr
    both = run("export", ref, str(tmp_path / "x"), "--out", str(tmp_path / "y"), "--db", db)
    assert both.exit_code == 2 and "name two" in both.stderr


@pytest.mark.hub
def test_pull_repo_option(hub_env, db):
    v1 = register(db, hub_env.tmp / "a1", seed=1)
    assert run("push", v1.ref, "--repo", "alice/kvmap", "--db", db).exit_code == 0
    pulled = run("pull", "--repo", "alice/kvmap@v1", "--db", str(hub_env.tmp / "other.db"), "--format", "json")
    assert pulled.exit_code == 0, pulled.output
    assert json.loads(pulled.stdout)["revision"] == "v1"
