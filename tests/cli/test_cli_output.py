"""The CLI is safe to pipe and script: unwrapped tables off a terminal, --format json|tsv, one JSON
vocabulary, show's summary, rm that needs a version, read-only commands that never create a store."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvhub.cli.main import main
from kvhub.errors import ConfigError, NotFoundError

LONG_SRC = "acme-research-laboratories/an-unusually-long-source-model-name-0.5B-Instruct"
LONG_DST = "acme-research-laboratories/an-unusually-long-target-model-name-1.5B-Instruct"


@pytest.fixture
def cli(tmp_path, monkeypatch):
    """``cli(*args, expect=0)`` against a SQLite store in tmp_path; stdout is not a terminal."""
    monkeypatch.setenv("KVHUB_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KVHUB_DB_URL", raising=False)
    db = tmp_path / "store" / "kvhub.db"
    runner = CliRunner()

    def run(*args, expect: int = 0, db_path=db):
        result = runner.invoke(main, [*map(str, args), "--db", str(db_path)], catch_exceptions=False)
        assert result.exit_code == expect, result.output
        return result

    run.db = db
    return run


@pytest.fixture
def two_versions(cli, artifact_factory):
    metrics = {"heldout_r2_k_mean": 0.91, "heldout_r2_k_mean_excluding_sinks": 0.88, "heldout_r2_v_mean": 0.8}
    for seed in (1, 2):
        cli("import", artifact_factory(seed=seed, source=LONG_SRC, target=LONG_DST, metrics=metrics))
    return f"{LONG_SRC}:{LONG_DST}:legal-docs"


def test_piped_tables_keep_every_reference_and_name_on_one_line(cli, two_versions):
    lines = cli("list").stdout.splitlines()
    assert lines[0].split()[:3] == ["REF", "ALIASES", "CREATED"]
    refs = [line.split()[0] for line in lines[1:]]
    assert refs == [
        "an-unusually-long-source-model-name-0.5B-Instruct:"
        f"an-unusually-long-target-model-name-1.5B-Instruct:legal-docs@v{n}"
        for n in (1, 2)
    ]
    shown = cli("show", f"{two_versions}@v2").stdout
    names = [line.split()[0] for line in shown.splitlines() if line.startswith("heldout_")]
    assert names == ["heldout_r2_k_mean", "heldout_r2_k_mean_excluding_sinks", "heldout_r2_v_mean"]
    assert f"{two_versions}@v2" in shown.splitlines()[0]  # the reference, whole, on the first line


def test_tsv_and_json_formats(cli, two_versions):
    tsv = [line.split("\t") for line in cli("list", "--format", "tsv").stdout.splitlines()]
    assert tsv[0][0] == "REF" and [row[0] for row in tsv[1:]] == [f"{two_versions}@v1", f"{two_versions}@v2"]
    assert len({len(row) for row in tsv}) == 1
    assert cli("list", "--json").stdout == cli("list", "--format", "json").stdout
    fields = dict(
        line.split("\t", 1) for line in cli("show", f"{two_versions}@v1", "--format", "tsv").stdout.splitlines()
    )
    assert fields["ref"] == f"{two_versions}@v1" and float(fields["metric.heldout_r2_v_mean"]) == 0.8
    assert "metric.r2_k.layer0" not in fields
    assert "metric.r2_k.layer0" in cli("show", f"{two_versions}@v1", "--format", "tsv", "--layers").stdout
    refused = cli("list", "--json", "--format", "tsv", expect=2)
    assert "contradict" in refused.output


def test_one_json_vocabulary(cli, two_versions, artifact_factory):
    listed = json.loads(cli("list", "--json").stdout)
    shown = json.loads(cli("show", f"{two_versions}@v2", "--json").stdout)
    assert listed[1]["ref"] == shown["ref"] == f"{two_versions}@v2"
    assert "id" not in listed[1] and "id" not in shown and shown["version"] == 2
    listed_keys = {tuple(sorted(m)) for m in listed[1]["metrics"]}
    shown_keys = {tuple(sorted(m)) for m in shown["metrics"]}
    assert listed_keys == shown_keys and len(listed_keys) == 1
    assert {m["name"] for m in listed[1]["metrics"]} == {m["name"] for m in shown["metrics"] if m["layer"] is None}
    imported = json.loads(cli("import", artifact_factory(seed=7, source=LONG_SRC, target=LONG_DST), "--json").stdout)
    assert imported["ref"] == f"{two_versions}@v3" and imported["version"] == 3 and "id" not in imported


def test_show_is_a_summary_unless_layers(cli, two_versions):
    summary = cli("show", f"{two_versions}@v1").stdout
    assert "selected layers" not in summary and "per-layer values: --layers" in summary
    detailed = cli("show", f"{two_versions}@v1", "--layers").stdout
    assert "selected layers" in detailed and "r2_k" in detailed


def test_rm_without_a_version_refuses_and_says_how(cli, two_versions):
    refused = cli("rm", two_versions, expect=ConfigError.exit_code)
    assert f"kvhub rm {two_versions}@v2" in refused.stderr
    assert len(json.loads(cli("list", "--json").stdout)) == 2
    cli("rm", f"{two_versions}@v1")
    assert [v["version"] for v in json.loads(cli("list", "--json").stdout)] == [2]


def test_a_mistyped_db_is_never_created_by_read_only_commands(cli, two_versions, tmp_path):
    typo = tmp_path / "store" / "kvhbu.db"
    for args in (
        ["list"],
        ["show", two_versions],
        ["rm", f"{two_versions}@v1"],
        ["export", two_versions, tmp_path / "out"],
        ["db", "current"],
        ["tag", two_versions, "production"],
    ):
        refused = cli(*args, expect=NotFoundError.exit_code, db_path=typo)
        assert f"no kvhub store at {typo}" in refused.stderr
    assert not typo.exists() and not (tmp_path / "out").exists()


def test_identical_tensors_are_one_version(cli, artifact_factory, tmp_path):
    first = artifact_factory(seed=1)
    cli("import", first)
    (first / "heatmap.png").write_bytes(b"\x89PNG\r\n\x1a\n")  # other files, same tensors
    again = cli("import", first, "--json")
    assert json.loads(again.stdout)["version"] == 1 and json.loads(again.stdout)["already_registered"] is True
    assert "nothing to do" in cli("import", first).stderr
    assert len(json.loads(cli("list", "--json").stdout)) == 1
    assert [p.name for p in (tmp_path / "store" / "artifacts").rglob("heatmap.png")] == []  # duplicate copy dropped


def _summary_mapper():
    """What fit_cmd._print_summary reads of a fitted mapper, with names Rich would take for markup."""
    from types import SimpleNamespace

    from kvhub.artifact.kinds import MAP_KINDS

    return SimpleNamespace(
        metadata={"metrics": {}, "fit": {"timings": {}}, "notes": []},
        layers=[],
        source={"model_id": "/m/[red]src"},
        target={"model_id": "/m/[/]dst"},
        num_parameters=lambda: 10,
        kind=MAP_KINDS["ridge"],
        kind_settings=lambda: {},
    )


def test_fit_summary_prints_names_verbatim(capsys):
    from kvhub.cli import fit_cmd

    mapper = _summary_mapper()
    reference = "/m/[red]src:/m/[/]dst:calib@v1"
    fit_cmd._print_summary(mapper, reference=reference, full_ref=reference, out=None, output_format="table")
    printed = capsys.readouterr().out
    assert f"registered {reference}" in printed and "/m/[red]src -> /m/[/]dst" in printed


def test_fit_ends_with_the_next_commands(capsys):
    """The end of a fit names what to do with the version, as push ends with its URL: one `next:` line on
    stderr with `kvhub show`, `kvhub eval` and `kvhub push` of the registered reference (quoted for the shell);
    a fit kept only in --out points at `kvhub import`; --json prints no hint.

    Planted bugs caught: no next step (ux-4 U4-22); the hint on stdout (a script's table or JSON polluted);
    a placeholder instead of the registered reference; a hint for a version that was never registered."""
    from kvhub.cli import fit_cmd

    reference = "small:large:support notes@v1"
    fit_cmd._print_summary(_summary_mapper(), reference=reference, full_ref=reference, out=None, output_format="tsv")
    printed = capsys.readouterr()
    quoted = "'small:large:support notes@v1'"
    assert "next:" not in printed.out
    hint = [line for line in printed.err.splitlines() if line.startswith("next:")]
    assert hint == [
        f"next: kvhub show {quoted}; kvhub eval {quoted} --task hellaswag; kvhub push {quoted} --repo OWNER/NAME"
    ]
    fit_cmd._print_summary(_summary_mapper(), reference=None, full_ref=None, out="./mapper", output_format="table")
    assert "next: kvhub import ./mapper" in capsys.readouterr().err
    fit_cmd._print_summary(_summary_mapper(), reference=reference, full_ref=reference, out=None, output_format="json")
    assert "next:" not in str(capsys.readouterr())


def test_a_closed_pipe_ends_quietly(cli, two_versions, tmp_path):
    import subprocess
    import sys

    code = "from kvhub.cli.main import main; main()"
    command = f"{sys.executable} -c '{code}' show '{two_versions}@v1' --layers --db {cli.db} | head -1"
    done = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
