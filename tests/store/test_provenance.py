"""What a fit leaves to tell it apart later (ux-3 U3-24): the store's lineage holds the command's options,
mapper.json's fit block where the fit ran (dtype, device), `kvhub diff` compares calibration size, seed,
stride and the fit block, and `show --history --format tsv` tells reruns apart by n and time."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvhub.cli.main import main
from kvhub.store import open_store
from tests.fixtures_store import make_store_artifact
from tests.fixtures_fit import tiny_fit_args


def test_a_fit_records_its_options_dtype_and_device(tiny_model_dirs, tmp_path, monkeypatch, text_corpus):
    monkeypatch.setenv("KVHUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KVHUB_HOME", str(tmp_path / "home"))
    src, dst = tiny_model_dirs
    db = str(tmp_path / "store.db")
    runner = CliRunner()
    refs = []
    for seed in (0, 1):
        result = runner.invoke(
            main,
            tiny_fit_args(src, dst, calib=text_corpus, lambda_="1e-9", batch_size=4, seed=seed, db=db, json=True),
        )
        assert result.exit_code == 0, result.output
        refs.append(json.loads(result.stdout)["ref"])
    with open_store(db) as store:
        version = store.resolve(refs[0])
        lineage = version.lineage
        metadata = json.loads((store.artifact_path(version) / "mapper.json").read_text())
    assert lineage["created_by"] == "kvhub fit" and lineage["options"]["samples"] == 12
    assert lineage["options"]["dtype"] == "float32" and lineage["kvhub_version"]
    assert lineage["options"]["seed"] == 0 and lineage["options"]["device"] == "cpu"
    plumbing = {"as_json", "output_format", "db", "no_register", "nproc", "restart", "ignore_plan", "out", "name"}
    assert not plumbing & set(lineage["options"]), lineage["options"]  # how the command ran, not the mapper (U4-18)
    assert (metadata["fit"]["dtype"], metadata["fit"]["device"]) == ("float32", "cpu")
    diff = runner.invoke(main, ["diff", *refs, "--db", db, "--format", "tsv"])
    assert diff.exit_code == 0, diff.output
    fields = {line.split("\t")[0]: line.split("\t") for line in diff.stdout.splitlines()[1:]}
    assert "fit dtype" in fields and "fit batch size" in fields and "calibration sequences" in fields
    assert fields["calibration seed"][1:3] == ["0", "1"]


def test_history_tsv_tells_reruns_apart(tmp_path):
    db = str(tmp_path / "store.db")
    with open_store(db) as store:
        version = store.register(make_store_artifact(tmp_path / "a"))
        for n in (8, 4):
            store.add_metrics(
                version, [{"name": "retention", "value": 1.0, "task": "hellaswag", "split": "eval", "n": n}]
            )
    result = CliRunner().invoke(main, ["show", version.ref, "--history", "--format", "tsv", "--db", db])
    assert result.exit_code == 0, result.output
    rows = [line.split("\t") for line in result.stdout.splitlines() if line.startswith("metric.retention")]
    assert [row[2] for row in rows] == ["8", "4"] and all(row[3] for row in rows)
