"""`kvhub show`'s table puts a metric's 95% interval beside its value, `0.350 [0.150, 0.550]`, as the eval table
does, instead of a row per bound (ux-4 U4-18); TSV and JSON keep the bounds as their own keys."""

from __future__ import annotations

import json

from kvhub.store import open_store
from tests.fixtures_hub import run
from tests.fixtures_store import make_store_artifact


def _measured(store, version, *, value: float, low: float | None, high: float | None, n: int) -> None:
    base = {"task": "hellaswag", "split": "eval", "n": n}
    rows = [{"name": "acc_drop", "value": value, **base}]
    if low is not None:
        rows += [{"name": "acc_drop_ci_low", "value": low, **base}, {"name": "acc_drop_ci_high", "value": high, **base}]
    store.add_metrics(version, rows)


def _table_rows(*args: str) -> list[str]:
    result = run("show", *args)
    assert result.exit_code == 0, result.output
    return [line for line in result.stdout.splitlines() if "acc_drop" in line]


def test_show_writes_an_interval_beside_its_value(tmp_path):
    """Planted bug caught: acc_drop, acc_drop_ci_high and acc_drop_ci_low as three rows of the table."""
    db = str(tmp_path / "store.db")
    with open_store(db) as store:
        version = store.register(make_store_artifact(tmp_path / "a"))
        _measured(store, version, value=0.35, low=0.15, high=0.55, n=20)
    rows = _table_rows(version.ref, "--db", db)
    assert len(rows) == 1 and "0.350 [0.150, 0.550]" in rows[0] and "_ci_" not in rows[0]
    tsv = run("show", version.ref, "--db", db, "--format", "tsv").stdout
    assert "metric.acc_drop_ci_low.hellaswag\t0.15" in tsv and "metric.acc_drop.hellaswag\t0.35" in tsv
    names = {m["name"] for m in json.loads(run("show", version.ref, "--db", db, "--json").stdout)["metrics"]}
    assert {"acc_drop", "acc_drop_ci_low", "acc_drop_ci_high"} <= names


def test_history_pairs_each_run_with_its_own_interval(tmp_path):
    """A rerun whose interval was not finite (none stored) shows its value alone, never beside the older run's
    bounds."""
    db = str(tmp_path / "store.db")
    with open_store(db) as store:
        version = store.register(make_store_artifact(tmp_path / "a"))
        _measured(store, version, value=0.35, low=0.15, high=0.55, n=20)
        _measured(store, version, value=0.30, low=None, high=None, n=8)
    history = _table_rows(version.ref, "--db", db, "--history")
    assert len(history) == 2 and "0.350 [0.150, 0.550]" in history[0]
    assert "0.300" in history[1] and "[" not in history[1]
    newest = _table_rows(version.ref, "--db", db)  # the older run's bounds stay rows of their own (n 20)
    assert "0.300" in newest[0] and "[" not in newest[0] and all("_ci_" in row for row in newest[1:])
