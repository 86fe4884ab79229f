"""Calibration recipes: the built-in catalog parses, bad recipes and unknown names fail helpfully."""

from __future__ import annotations

import pytest

from kvhub.calib import heldout_count, list_calibration_sets, load_recipe, recipe_from_spec
from kvhub.calib.recipe import builtin_names, catalog_dir
from kvhub.errors import ConfigError, NotFoundError, RecipeError, UnknownCalibrationError

BUILTINS = ("chat", "code", "docs", "general", "legal-docs", "medical", "mixed")

GOOD = """
version = 1
description = "test set"
licence = "CC0-1.0"

[[sources]]
kind = "path"
path = "texts"

[sequences]
seq_len = 32
samples = 4
"""


def test_every_builtin_recipe_parses():
    recipes = {recipe.name: recipe for recipe in list_calibration_sets()}
    assert set(BUILTINS) <= set(recipes)
    for name, recipe in recipes.items():
        assert (catalog_dir() / f"{name}.toml").is_file()
        assert recipe.version >= 1 and recipe.description and recipe.licence
        assert recipe.sequences.samples * recipe.sequences.seq_len >= 16 * 512
        for source in recipe.sources:
            assert source.licence, f"{name}: every source states its licence"
            if source.kind == "pypi":
                assert len(source.sha256) == 64, f"{name}: PyPI corpora are pinned by sha256"


def test_the_default_calibration_is_one_built_in_set_everywhere():
    from kvhub.calib.recipe import DEFAULT_CALIBRATION
    from kvhub.cli.fit_cmd import fit
    from kvhub.fitting.job import FitRequest

    assert DEFAULT_CALIBRATION in builtin_names()
    assert FitRequest(src="a", dst="b").calib == DEFAULT_CALIBRATION
    assert next(p for p in fit.params if p.name == "calib").default == DEFAULT_CALIBRATION


def test_mixed_renders_conversations_with_the_chat_template_and_keeps_every_token():
    recipe = load_recipe("mixed")
    assert recipe.sequences.chat_template and recipe.sequences.stride == 1
    assert [source.format for source in recipe.sources] == ["chitchat", "oe-eval-requests", "text"]


def test_legal_docs_default_size_fits_ten_minutes_on_two_cores():
    sequences = load_recipe("legal-docs").sequences
    assert (sequences.samples, sequences.heldout_samples, sequences.seq_len) == (64, 16, 512)
    assert (sequences.samples + sequences.heldout_samples) * 7.4 <= 660  # ~7.4 s per 512-token sequence
    assert sequences.stride == 4


@pytest.mark.parametrize("samples,fraction,expected", [(64, 0.2, 16), (1, 0.2, 1), (10, 0.5, 10), (100, 0.1, 11)])
def test_heldout_count(samples, fraction, expected):
    assert heldout_count(samples, fraction) == expected


def _write(tmp_path, text, name="my-set.toml"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_user_recipe_defaults_its_name_to_the_file_stem(tmp_path):
    recipe = load_recipe(_write(tmp_path, GOOD))
    assert recipe.name == "my-set" and recipe.sequences.seq_len == 32 and recipe.sequences.stride == 4


@pytest.mark.parametrize(
    "edit,field,expected",
    [
        (lambda t: t.replace("version = 1\n", ""), "version", "an integer"),
        (lambda t: t.replace("version = 1", 'version = "1"'), "version", "an integer"),
        (lambda t: t.replace('licence = "CC0-1.0"\n', ""), "licence", "a string"),
        (lambda t: t.replace("seq_len = 32", 'seq_len = "32"'), "sequences.seq_len", "an integer"),
        (lambda t: t.replace("samples = 4", "samples = true"), "sequences.samples", "an integer"),
        (lambda t: t.replace("samples = 4", "samples = 0"), "sequences.samples", "an integer >= 1"),
        (lambda t: t + "heldout_fraction = 1.5\n", "sequences.heldout_fraction", "a number in (0, 1)"),
        (lambda t: t.replace('path = "texts"', "path = 3"), "sources[0].path", "a string"),
        (lambda t: t.replace('path = "texts"', ""), "sources[0].path", "a string"),
        (lambda t: t.replace('kind = "path"', 'kind = "ftp"'), "sources[0].kind", "one of"),
        (
            lambda t: t.replace('path = "texts"', 'path = "texts"\nfiles = "*.txt"'),
            "sources[0].files",
            "an array of strings",
        ),
        (lambda t: t.split("[[sources]]")[0], "sources", "an array of tables"),
    ],
)
def test_bad_recipe_names_file_field_and_type(tmp_path, edit, field, expected):
    path = _write(tmp_path, edit(GOOD))
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    error = info.value
    assert error.path == str(path) and error.field == field and error.expected.startswith(expected)
    assert str(path) in str(error) and f"`{field}`" in str(error)
    assert isinstance(error, ConfigError) and error.exit_code == 2


def test_pypi_source_needs_package_version_files(tmp_path):
    text = GOOD.replace('kind = "path"\npath = "texts"', 'kind = "pypi"\npackage = "spdx"\nfiles = ["*.txt"]')
    with pytest.raises(RecipeError, match=r"`sources\[0\].version` is missing \(expected a string\)"):
        load_recipe(_write(tmp_path, text))


def test_unknown_field_is_dropped_with_a_warning(tmp_path, caplog):
    recipe = load_recipe(_write(tmp_path, GOOD + "colour = 'blue'\n"))
    assert recipe.sequences.samples == 4
    assert "sequences.colour" in caplog.text


def test_invalid_toml_names_the_file(tmp_path):
    path = _write(tmp_path, "version = = 1")
    with pytest.raises(RecipeError, match="not valid TOML") as info:
        load_recipe(path)
    assert str(path) in str(info.value)


def test_unknown_name_lists_known_sets_and_how_to_add():
    with pytest.raises(UnknownCalibrationError) as info:
        recipe_from_spec("legal-doc")
    message = str(info.value)
    for name in BUILTINS:
        assert name in message
    assert ".jsonl" in message and ".toml" in message and "hf:" in message
    assert isinstance(info.value, NotFoundError) and isinstance(info.value, LookupError)
    assert info.value.known == builtin_names()
    with pytest.raises(UnknownCalibrationError):
        load_recipe("nope")


def test_missing_path_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        recipe_from_spec(str(tmp_path / "absent.txt"))


def test_builtin_name_wins_over_a_same_named_directory(tmp_path, monkeypatch):
    (tmp_path / "docs").mkdir()
    monkeypatch.chdir(tmp_path)
    assert recipe_from_spec("docs").origin.endswith("docs.toml")
    local = recipe_from_spec("./docs")
    assert local.name == "local-docs" and local.sources[0].kind == "path"


@pytest.mark.parametrize(
    "spec,dataset,config,split,template",
    [
        ("hf:wikitext:wikitext-2-raw-v1:train:text", "wikitext", "wikitext-2-raw-v1", "train", "{text}"),
        ("hf:allenai/c4:validation:text", "allenai/c4", "", "validation", "{text}"),
    ],
)
def test_hf_spec(spec, dataset, config, split, template):
    recipe = recipe_from_spec(spec)
    source = recipe.sources[0]
    assert (source.kind, source.dataset, source.config, source.split, source.template) == (
        "hf",
        dataset,
        config,
        split,
        template,
    )
    assert recipe.name.startswith("hf-") and ":" not in recipe.name


@pytest.mark.parametrize("spec", ["hf:wikitext", "hf:a:b:c:d:e", "hf::train:text"])
def test_bad_hf_spec(spec):
    with pytest.raises(ConfigError, match="hf:"):
        recipe_from_spec(spec)
