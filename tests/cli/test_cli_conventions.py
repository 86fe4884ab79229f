"""Conventions every command keeps (ux-2 U1 .. U33): a single .txt calibration file, tables that are never
cut, Ctrl-C's status and rates, one output switch, refusals before any forward pass, readable plans, -h,
the exit-code table, quiet loading, and messages that name the real cause."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvhub.cli.main import main
from kvhub.errors import ConfigError, CorpusTooSmallError, FitError, ModelUnavailableError
from tests.fixtures_calib import config_only_model
from tests.fixtures_fit import tiny_fit_args

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("KVHUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KVHUB_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KVHUB_DB_URL", raising=False)
    return {"db": f"sqlite:///{tmp_path / 'store.db'}", "tmp": tmp_path}


@pytest.fixture
def config_only(monkeypatch, tmp_path):
    """A model directory with only a config (2 layers, KV width 2 x 16 = 32); loading any model fails."""
    return config_only_model(tmp_path / "cfg", monkeypatch)


# ---- U1: one .txt file is a calibration set --------------------------------------------------------
def test_fit_from_a_single_txt_file(tiny_model_dirs, env):
    """The README flow with `--calib notes.txt`: paragraphs are documents, so train and held-out text are
    disjoint; the JSON ref is the full reference, as `kvhub list --json` gives it (U15)."""
    src, dst = tiny_model_dirs
    notes = env["tmp"] / "notes.txt"
    notes.write_text("\n\n".join(f"p{i:03d} " * (12 + i % 5) for i in range(60)), encoding="utf-8")
    runner = CliRunner()
    result = runner.invoke(
        main,
        tiny_fit_args(
            src, dst, calib=notes, samples=8, seq_len=16, batch_size=4, db=env["db"], out=env["tmp"] / "m", json=True
        ),
    )
    assert result.exit_code == 0, result.output
    calibration = json.loads((env["tmp"] / "m" / "mapper.json").read_text())["calibration"]
    assert calibration["documents"]["train"] > 1 and calibration["documents"]["heldout"] >= 1
    listed = json.loads(runner.invoke(main, ["list", "--db", env["db"], "--json"]).stdout)
    assert json.loads(result.stdout)["ref"] == listed[0]["ref"]


def test_one_document_says_it_cannot_be_split(calib_home, tmp_path, calib_tokenizer):
    from kvhub.calib import resolve_calibration

    lines = tmp_path / "lines.txt"
    lines.write_text("\n".join(f"line {i} " + "x y z " * 8 for i in range(80)), encoding="utf-8")
    built = resolve_calibration(str(lines), tokenizer=calib_tokenizer, tokenizer_id="t", samples=8, seq_len=16)
    assert built.train_documents > 1  # no blank lines: one document per line
    one = tmp_path / "one.jsonl"  # one record: one document, however long
    one.write_text(json.dumps({"text": "w " * 4000}) + "\n", encoding="utf-8")
    with pytest.raises(CorpusTooSmallError) as info:
        resolve_calibration(str(one), tokenizer=calib_tokenizer, tokenizer_id="t", samples=8, seq_len=16)
    message = str(info.value)
    assert "its 1 document" in message and "cannot be split into disjoint train and held-out" in message
    assert "shorter --seq-len" not in message  # advice that could not help


# ---- U4: nothing is cut or wrapped off a terminal --------------------------------------------------
def test_piped_fit_and_plan_output_is_never_wrapped(monkeypatch, capsys):
    from types import SimpleNamespace

    from kvhub.artifact.kinds import MAP_KINDS
    from kvhub.cli import fit_cmd

    monkeypatch.setenv("COLUMNS", "40")  # as when stderr is on a narrow terminal and stdout is piped
    long_id = "/models/an-unusually-long-directory-name/source-model-0.5B"
    layer = {"target": 0, "sources": [0, 1], "lambda_k": 1e-3, "lambda_v": 1e-3, "r2_k": 0.5, "r2_v": 0.25}
    mapper = SimpleNamespace(
        metadata={"metrics": {}, "fit": {"timings": {}}, "notes": []},
        layers=[layer],
        source={"model_id": long_id},
        target={"model_id": long_id + "-target"},
        num_parameters=lambda: 10,
        kind=MAP_KINDS["ridge"],
        kind_settings=lambda: {},
    )
    fit_cmd._print_summary(mapper, reference="a:b:c@v1", full_ref="a:b:c@v1", out=None, output_format="table")
    lines = capsys.readouterr().out.splitlines()
    assert f"{long_id} -> {long_id}-target:" in lines
    assert any(
        re.fullmatch(r"target layer +source layers +k +lambda K/V +held-out R2 K +held-out R2 V", line)
        for line in lines
    )
    plan = CliRunner().invoke(main, ["plan", "--src", "Qwen/Qwen3-14B", "--dst", "Qwen/Qwen3-32B", "--device", "h200"])
    assert any(
        line.startswith("mode full on 1 rank(s): fits: device") and line.endswith("GiB")
        for line in plan.stdout.splitlines()
    )


# ---- U14, U23: Ctrl-C and rates ------------------------------------------------------------------
def test_a_bare_ctrl_c_exits_130(monkeypatch, env):
    import kvhub.cli.plan_cmd

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(kvhub.cli.plan_cmd, "_warn_past_positions", interrupted)
    result = CliRunner().invoke(main, ["plan", "--src", "Qwen/Qwen3-14B", "--dst", "Qwen/Qwen3-32B"])
    assert result.exit_code == 130 and "interrupted" in result.stderr and "Aborted!" not in result.output


def test_rates_count_this_run_and_name_their_unit():
    from kvhub.cli.progress import LineProgress

    now, lines = [0.0], []
    line_progress = LineProgress("items", interval=0, clock=lambda: now[0], write=lines.append)
    for second, done in ((0, 500), (10, 600)):  # resumed: 500 tokens were checkpointed
        now[0] = float(second)
        line_progress("capture: train batch 6/10", done, 1000)
    assert lines[-1] == "capture: train batch 6/10: 600/1,000 (60%), 10 tok/s, 0:10 elapsed, eta 0:40"
    for label, unit in (("tokenize", "tok/s"), ("read source 1/3 (pypi)", "files/s"), ("hellaswag", "items/s")):
        now[0] = 0.0
        line_progress(label, 0, 100)
        now[0] = 2.0
        line_progress(label, 100, 100)
        assert lines[-1].endswith(f"(100%), 50 {unit}, 0:02 elapsed"), lines[-1]


# ---- U15: one output switch ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "args",
    [
        ["calib", "list"],
        ["calib", "show", "legal-docs"],
        ["fetch", "models", "--list"],
        ["plan", "--src", "Qwen/Qwen3-14B", "--dst", "Qwen/Qwen3-32B", "--device", "h200"],
    ],
)
def test_format_json_and_tsv_everywhere(args, env):
    runner = CliRunner()
    as_json = runner.invoke(main, [*args, "--format", "json"])
    assert as_json.exit_code == 0, as_json.output
    json.loads(as_json.stdout)
    tsv = runner.invoke(main, [*args, "--format", "tsv"])
    assert tsv.exit_code == 0 and "\t" in tsv.stdout.splitlines()[0]
    assert runner.invoke(main, [*args, "--json"]).stdout == as_json.stdout


# ---- U17, U5: refused before any model loads -----------------------------------------------------
def test_too_few_observations_refused_before_any_forward_pass(config_only, env):
    runner = CliRunner()
    base = ["fit", "--src", str(config_only), "--dst", str(config_only), "--ignore-plan", "--calib", "legal-docs"]
    refused = runner.invoke(main, [*base, "--samples", "4", "--seq-len", "32"])  # 4 x 32/4 = 32 rows, 32 features
    assert refused.exit_code == FitError.exit_code, refused.output
    assert "32 training observations" in refused.stderr and "--samples 5" in refused.stderr
    plan = runner.invoke(
        main,
        [
            "plan",
            "--src",
            str(config_only),
            "--dst",
            str(config_only),
            "--device",
            "cpu",
            "--samples",
            "4",
            "--seq-len",
            "32",
        ],
    )
    assert plan.exit_code == FitError.exit_code and plan.stdout.startswith("verdict: kvhub fit would refuse")


def test_fit_takes_torch_devices_only(config_only, env):
    runner = CliRunner()
    base = ["fit", "--src", str(config_only), "--dst", str(config_only), "--ignore-plan", "--calib", "legal-docs"]
    profile = runner.invoke(main, [*base, "--device", "h100"])
    assert profile.exit_code == ConfigError.exit_code and "not a torch device" in profile.stderr
    assert "h100" not in runner.invoke(main, ["fit", "-h"]).stdout


# ---- U26: the plan's verdict ---------------------------------------------------------------------
def test_plan_says_when_nothing_fits(env):
    runner = CliRunner()
    args = ["plan", "--src", "Qwen/Qwen3-14B", "--dst", "Qwen/Qwen3-32B", "--device", "cpu", "--host-memory", "16"]
    result = runner.invoke(main, args)
    assert result.exit_code == FitError.exit_code
    assert result.stdout.startswith("verdict: does not fit on 1 to 8 ranks of cpu")
    assert re.search(r"total \d+:\d\d:\d\d", result.stdout) and " s," not in result.stdout
    assert "device peak" not in result.stdout  # RAM rows: one pool, its peak per rank and for all ranks
    data = json.loads(runner.invoke(main, [*args, "--json"]).stdout)
    assert data["fits"] is False


# ---- U27, U28: -h and the exit codes ---------------------------------------------------------------
@pytest.mark.parametrize("args", [["-h"], ["list", "-h"], ["calib", "build", "-h"], ["fit", "-h"]])
def test_dash_h_is_help(args):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0 and result.stdout.startswith("Usage:")


def test_one_exit_code_table_in_help_and_docs():
    from kvhub.errors import exit_codes

    helped = CliRunner().invoke(main, ["--help"]).stdout
    documented = (ROOT / "docs" / "cli.md").read_text()
    codes = exit_codes()
    assert {code for code, _, _ in codes} >= {0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 14, 16, 130}
    for code, name, _ in codes:
        row = re.compile(rf"^ *{code}  {re.escape(name)} ", re.MULTILINE)
        assert row.search(helped) and row.search(documented), (code, name)


# ---- U30, U33: loading models --------------------------------------------------------------------
def test_loading_weights_is_quiet_and_leaves_the_setting(tiny_model_dirs, capfd):
    from transformers.utils import logging as transformers_logging

    from kvhub.models.loading import load_model

    transformers_logging.enable_progress_bar()
    load_model(tiny_model_dirs[0], device="cpu", dtype="float32")
    assert "Loading weights" not in capfd.readouterr().err
    assert transformers_logging.is_progress_bar_enabled()


def test_a_mistyped_directory_says_so(tmp_path, monkeypatch):
    from kvhub.models.loading import load_model

    (tmp_path / "fam").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelUnavailableError, match="fam/srcx: no such directory; as a Hub id it is not in the local"):
        load_model("fam/srcx", device="cpu")
