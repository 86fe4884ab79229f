"""A recipe that renders conversations through the chat template, built with a tokenizer that has none (the
default `mixed` set on a base model): the conversations become plain `Role: text`, and that is said on the
kvhub logger (a warning on stderr in the CLI), not only written into the set's notes (ux-4 U4-21)."""

from __future__ import annotations

import json
import logging

from kvhub.calib import resolve_calibration
from tests.fixtures_calib import train_tokenizer

RECIPE = """version = 1\ndescription = 'chats'\nlicence = 'x'
[[sources]]\nkind = 'path'\npath = 'dataset.json'\nformat = 'chitchat'
[sequences]\nseq_len = 32\nsamples = 8\nchat_template = true
"""


def _chats(tmp_path):
    conversations = {
        f"c{i}": {"messages": [[{"text": f"hi {i} " * 20, "sender": "a"}], [{"text": "hello " * 20, "sender": "b"}]]}
        for i in range(20)
    }
    (tmp_path / "dataset.json").write_text(json.dumps(conversations), encoding="utf-8")
    (tmp_path / "chats.toml").write_text(RECIPE, encoding="utf-8")
    return str(tmp_path / "chats.toml")


def test_a_tokenizer_without_a_chat_template_is_said_when_the_set_is_built(calib_home, tmp_path, caplog):
    """Planted bug caught: the note only in the stored metadata, `kvhub fit` silent about it."""
    recipe = _chats(tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvhub"):
        built = resolve_calibration(recipe, tokenizer=train_tokenizer(), tokenizer_id="acme/base-model")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("acme/base-model has no chat template" in w and "plain" in w for w in warnings), warnings
    assert any("no chat template" in note for note in built.notes)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvhub"):  # the set from the cache: said again
        resolve_calibration(recipe, tokenizer=train_tokenizer(), tokenizer_id="acme/base-model")
    assert "acme/base-model has no chat template" in caplog.text


def test_a_tokenizer_with_one_is_not_warned_about(calib_home, tmp_path, caplog):
    recipe = _chats(tmp_path)
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with caplog.at_level(logging.WARNING, logger="kvhub"):
        resolve_calibration(recipe, tokenizer=train_tokenizer(chat_template=template), tokenizer_id="t")
    assert "chat template" not in caplog.text


def test_calib_build_says_it_once(calib_home, tmp_path, caplog):
    """Planted bug caught: the library's warning, then the set's note printed again as `warning: the tokenizer
    has no chat template: ...` (ux-4 U4-16)."""
    from click.testing import CliRunner

    from kvhub.cli.main import main

    train_tokenizer().save_pretrained(tmp_path / "tokenizer")
    with caplog.at_level(logging.WARNING, logger="kvhub"):
        result = CliRunner().invoke(
            main, ["calib", "build", _chats(tmp_path), "--tokenizer", str(tmp_path / "tokenizer")]
        )
    assert result.exit_code == 0, result.output
    said = [r for r in caplog.records if "no chat template" in r.getMessage()]
    printed = [line for line in result.stderr.splitlines() if "chat template" in line and line.startswith("warning:")]
    assert len(said) == 1 and not printed, (said, result.stderr)
