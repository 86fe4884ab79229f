"""`kvhub diff` compares plain values: the fit block's nested dicts (statistics, timings) become one row per
key, `fit statistics.dtype`, not a Python repr of the dict (ux-4 U4-18)."""

from __future__ import annotations

import json

from kvhub.core.mapper import Mapper
from kvhub.store import open_store
from tests.fixtures_hub import run
from tests.fixtures_store import make_store_artifact


def _with_fit(directory, *, seed: int, forward_s: float):
    base = Mapper.load(make_store_artifact(directory.parent / f"{directory.name}-base", seed=seed))
    fit = {"dtype": "float32", "statistics": {"dtype": "float64", "passes": 1}, "timings": {"forward_s": forward_s}}
    return Mapper(dict(base.tensors), {**base.metadata, "fit": fit}).save(directory)


def test_diff_flattens_the_fit_block_into_rows(tmp_path):
    """Planted bug caught: `fit statistics {'dtype': 'float64', 'passes': 1}` and `fit timings {...}` as one
    row each, their values Python reprs no script or reader can compare."""
    db = str(tmp_path / "store.db")
    with open_store(db) as store:
        refs = [store.register(_with_fit(tmp_path / f"a{s}", seed=s, forward_s=10.0 + s)).ref for s in (1, 2)]
    result = run("diff", *refs, "--db", db, "--json")
    assert result.exit_code == 0, result.output
    rows = {row["field"]: row for row in json.loads(result.stdout)["rows"]}
    assert rows["fit statistics.dtype"]["a"] == "float64" and rows["fit statistics.passes"]["b"] == 1
    assert rows["fit timings.forward_s"]["delta"] == 1.0 and rows["fit dtype"]["a"] == "float32"
    assert "fit statistics" not in rows and "fit timings" not in rows
