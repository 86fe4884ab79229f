"""Edges of eval and bench (ux-3 U3-26): bench refuses context lengths beyond the models' positions before
anything loads, as eval does, and item progress reads `items: 3/4`, not an item's id."""

from __future__ import annotations


def test_U3_26_bench_refuses_lengths_beyond_the_models(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from kvhub.cli.main import main
    from kvhub.errors import ConfigError
    from kvhub.eval import run
    from kvhub.store import open_store
    from tests.fixtures_store import make_store_artifact

    def no_load(*args, **kwargs):
        raise AssertionError("the models were loaded before the lengths were checked")

    monkeypatch.setattr(run, "load_version", no_load)
    db = str(tmp_path / "store.db")
    with open_store(db) as store:
        ref = store.register(make_store_artifact(tmp_path / "a")).ref
    result = CliRunner().invoke(main, ["bench", ref, "--lengths", "1024,65536", "--db", db])
    assert result.exit_code == ConfigError.exit_code, result.output
    assert "--lengths 65536 exceeds" in result.stderr


def test_U3_26_item_progress_is_labelled_items(tmp_path):
    import types

    from kvhub.eval.results_cache import score_items

    heard = []
    items = [types.SimpleNamespace(id=f"hellaswag/validation/{i}") for i in range(3)]
    score = types.SimpleNamespace(as_dict=lambda: {"x": 1})
    score_items(
        items,
        [tmp_path / "v.jsonl"],
        lambda item, missing: [score for _ in missing],
        from_dict=lambda d: d,
        progress=lambda label, done, total: heard.append(label),
    )
    assert set(heard) == {"items"}
