"""FitOptions declares each fit knob once: its rule refuses a bad value when the options are made (so
``kvhub fit`` refuses it before any model loads), the click options of ``kvhub fit`` and ``kvhub plan`` are
made from its fields, mapper.json's ``fit`` block is its ``fit_block()``, and "auto" is None everywhere
but in text."""

import json
import math

import click
import pytest
from click.testing import CliRunner

from kvhub.artifact.metadata import shown
from kvhub.cli.fit_cmd import fit as fit_command
from kvhub.cli.main import main
from kvhub.cli.plan_cmd import plan as plan_command
from kvhub.errors import ConfigError
from kvhub.fitting.options import FitOptions, auto_or, knobs
from tests.fixtures_fit import tiny_fit_args

# (knob, bad value, the flag the error names, what it says to use)
BAD = [
    ("top_k", 0, "--k", "a positive integer or 'auto'"),
    ("top_k", -2, "--k", "a positive integer or 'auto'"),
    ("top_k", True, "--k", "a positive integer or 'auto'"),
    ("top_k", 2.5, "--k", "a positive integer or 'auto'"),
    ("top_k", "four", "--k", "a positive integer or 'auto'"),
    ("ridge_lambda", -1.0, "--lambda", "a finite non-negative number or 'auto'"),
    ("ridge_lambda", math.nan, "--lambda", "a finite non-negative number or 'auto'"),
    ("ridge_lambda", math.inf, "--lambda", "a finite non-negative number or 'auto'"),
    ("stride", 0, "--stride", "a positive integer"),
    ("batch_size", 0, "--batch-size", "a positive integer"),
    ("batch_size", None, "--batch-size", "a positive integer"),
    ("weighting", "entropy", "--weighting", "one of uniform, attention"),
    ("weight_cap", 0.0, "weight_cap=", "a finite positive number"),
    ("head_local", "yes", "--head-local", "True or False"),
    ("rank", 0, "--rank", "a positive integer"),
    ("skip_first", -1, "skip_first=", "a non-negative integer"),
    ("statistics", "three-pass", "--stats", "one of auto, one-pass, two-pass"),
    ("capture", "three-phase", "--capture", "one of auto, one-phase, two-phase"),
    ("target_layout", "sideways", "--target-layout", "one of auto, whole, layer-outer"),
    ("candidates", 0, "--candidates", "a positive integer"),
    ("map_kind", "cubic", "--map", "one of ridge, mlp"),
    ("mlp_width", 0, "--mlp-width", "an integer in 1..65536"),
    ("mlp_width", 65537, "--mlp-width", "an integer in 1..65536"),
    ("mlp_depth", 0, "--mlp-depth", "an integer in 1..64"),
    ("mlp_depth", 65, "--mlp-depth", "an integer in 1..64"),
    ("mlp_tokens", 0, "--mlp-tokens", "an integer of at least 2 (an R^2 needs two rows per split)"),
    ("mlp_tokens", 1, "--mlp-tokens", "an integer of at least 2 (an R^2 needs two rows per split)"),
    ("mlp_epochs", 0, "--mlp-epochs", "an integer in 1..1048576"),
    ("mlp_seed", -1, "mlp_seed=", "an integer in 0..9223372036854775807"),
]


@pytest.mark.parametrize("name, value, flag, use", BAD, ids=[f"{b[0]}={b[1]!r}" for b in BAD])
def test_each_rule_refuses_when_the_options_are_made(name, value, flag, use):
    with pytest.raises(ConfigError) as refused:
        FitOptions(**{name: value})
    assert flag in str(refused.value) and str(refused.value).endswith(f"use {use}")


def test_every_knob_has_a_rule_and_its_default_passes_it():
    """A knob without a rule would take anything; a default its own rule refuses would make FitOptions()
    fail.  The table above names a bad value for every knob."""
    assert {spec.name for spec in knobs()} == {row[0] for row in BAD}
    FitOptions()


def test_auto_is_none_and_only_text_says_auto():
    options = FitOptions(top_k="auto", ridge_lambda="auto")
    assert options.top_k is None and options.ridge_lambda is None
    assert FitOptions(top_k=3, ridge_lambda=0).top_k == 3
    assert auto_or("auto", int) is None and auto_or(" 3", int) == 3 and auto_or(None, float) is None
    with pytest.raises(ValueError):
        auto_or("three", int)
    assert [shown(None), shown("auto"), shown(4), shown(0.01)] == ["auto", "auto", 4, 0.01]


def test_the_fit_block_is_the_recorded_knobs():
    block = FitOptions(stride=2, batch_size=3, weighting="attention", weight_cap=5.0, skip_first=1).fit_block()
    assert block == {"stride": 2, "batch_size": 3, "weighting": "attention", "weight_cap": 5.0, "skip_first": 1}


def _flags(command: click.Command) -> dict[str, click.Option]:
    return {opt: param for param in command.params for opt in param.opts}


@pytest.mark.parametrize(
    "command, names",
    [
        (fit_command, [s.name for s in knobs() if s.metadata["flag"]]),
        (plan_command, ["stride", "batch_size", "top_k", "statistics", "candidates"]),
    ],
)
def test_click_options_are_made_from_the_fields(command, names):
    """Each knob's flag exists on the command, under the knob's own name, with the knob's default; fit's
    help is the knob's help (a knob added to FitOptions reaches `kvhub fit` by its listing only)."""
    flags = _flags(command)
    for spec in knobs():
        if spec.name not in names:
            continue
        option = flags[spec.metadata["flag"]]
        assert option.name == spec.name
        assert option.default == ("auto" if spec.metadata["auto"] else spec.default)
        if command is fit_command:
            assert option.help == spec.metadata["help"]


@pytest.mark.parametrize(
    "args, words",
    [
        (["--lambda", "-1"], "--lambda"),
        (["--lambda", "nan"], "--lambda"),
        (["--k", "0"], "use a positive integer or 'auto'"),
        (["--k", "two"], "use a positive integer or 'auto'"),
        (["--stride", "0"], "use a positive integer"),
        (["--stats", "one-pass", "--candidates", "2"], "--candidates sets what a two-pass fit"),
        (["--map", "mlp", "--mlp-width", "65537"], "--mlp-width': use an integer in 1..65536"),
        (["--map", "mlp", "--mlp-depth", "65"], "--mlp-depth': use an integer in 1..64"),
        (["--map", "mlp", "--mlp-tokens", "1"], "--mlp-tokens': use an integer of at least 2"),
        (["--mlp-width", "64", "--mlp-depth", "3"], "--mlp-width, --mlp-depth set the residual MLP of --map mlp"),
        (["--mlp-epochs", "100"], "--mlp-epochs sets the residual MLP of --map mlp; add --map mlp"),
        (["--mlp-tokens", "64", "--map", "ridge"], "--mlp-tokens sets the residual MLP of --map mlp"),
    ],
)
def test_kvhub_fit_refuses_a_bad_knob_before_any_model_loads(args, words, tmp_path, monkeypatch):
    """The models do not exist: a refusal that came after loading would name them instead.

    Planted bugs caught: --mlp-width / --mlp-depth bounds other than the artifact's (a 65537-wide fit ran to
    the end, then was refused as a corrupt artifact); --mlp-* options taken and ignored without --map mlp
    (also at their default value); --mlp-tokens 1 (a held-out R^2 over one row, -2e28)."""
    monkeypatch.setenv("KVHUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KVHUB_HOME", str(tmp_path / "home"))
    result = CliRunner().invoke(
        main,
        [
            "fit",
            "--src",
            str(tmp_path / "no-src"),
            "--dst",
            str(tmp_path / "no-dst"),
            "--db",
            f"sqlite:///{tmp_path / 's.db'}",
            *args,
        ],
    )
    assert result.exit_code == 2, result.output
    assert words in " ".join(result.output.split()) and "no-src" not in result.output
    assert "Traceback" not in result.output and not (tmp_path / "s.db").exists()


@pytest.mark.parametrize(
    "args, code, words",
    [
        (["--mlp-tokens", "5000000"], 2, "--mlp-tokens sets the residual MLP of --map mlp"),
        (["--map", "ridge", "--mlp-tokens", "8192"], 2, "--mlp-tokens sets the residual MLP of --map mlp"),
        (["--map", "mlp", "--mlp-tokens", "1"], 2, "use an integer of at least 2"),
    ],
)
def test_kvhub_plan_refuses_mlp_tokens_without_an_mlp_fit(args, code, words, tmp_path):
    """Planted bugs caught: plan costing nothing for --mlp-tokens without --map mlp, and saying nothing."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4}))
    result = CliRunner().invoke(main, ["plan", "--src", str(config), "--dst", str(config), *args])
    assert result.exit_code == code, result.output
    assert words in " ".join(result.output.split()) and "Traceback" not in result.output


def test_mlp_knobs_without_the_mlp_kind_are_refused_in_python():
    """FitOptions as the library takes it: a changed --mlp-* knob on a ridge fit is refused, a default is not."""
    with pytest.raises(ConfigError, match="--mlp-width sets the residual MLP of --map mlp"):
        FitOptions(mlp_width=64)
    with pytest.raises(ConfigError, match="mlp_seed= sets"):
        FitOptions(map_kind="ridge", mlp_seed=3)
    assert FitOptions(map_kind="mlp", mlp_width=64, mlp_tokens=2).mlp_width == 64
    FitOptions(map_kind="ridge")


def test_a_fit_without_k_or_lambda_writes_null_and_shows_auto(tiny_model_dirs, tmp_path, monkeypatch, text_corpus):
    monkeypatch.setenv("KVHUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KVHUB_HOME", str(tmp_path / "home"))
    src, dst = tiny_model_dirs
    db = f"sqlite:///{tmp_path / 'store.db'}"
    result = CliRunner().invoke(
        main,
        tiny_fit_args(src, dst, calib=text_corpus, batch_size=2, db=db, out=tmp_path / "out", json=True),
    )
    assert result.exit_code == 0, result.output
    metadata = json.loads((tmp_path / "out" / "mapper.json").read_text())
    assert metadata["k"] is None and metadata["lambda"] is None
    assert metadata["fit"]["stride"] == 1 and metadata["fit"]["batch_size"] == 2
    summary = json.loads(result.stdout)
    assert summary["k"] == "auto" and summary["lambda"] == "auto"
    listed = json.loads(CliRunner().invoke(main, ["list", "--db", db, "--json"]).stdout)
    assert listed[0]["k"] == "auto" and listed[0]["ridge_lambda"] == "auto"
    assert listed[0]["lambda"] == "auto"  # one name with fit --json and diff; ridge_lambda kept for older scripts
    shown_json = json.loads(CliRunner().invoke(main, ["show", listed[0]["ref"], "--db", db, "--json"]).stdout)
    assert shown_json["lambda"] == shown_json["ridge_lambda"] == "auto"
    diff = json.loads(
        CliRunner().invoke(main, ["diff", listed[0]["ref"], listed[0]["ref"], "--db", db, "--json"]).stdout
    )
    assert any(row["field"] == "lambda" and row["a"] == "auto" for row in diff["rows"])
