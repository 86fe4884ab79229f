"""Tables on a terminal keep every cell whole (ux-3 U3-6): a reference, a repository id or a task name
is one string to copy, at 80 columns as in a pipe."""

from __future__ import annotations

import io

import pytest

from kvhub.cli import output
from kvhub.cli.console import DataConsole

REF = "Qwen2.5-Coder-0.5B-Instruct:Qwen2.5-Coder-1.5B-Instruct:legal-docs@v1"


@pytest.fixture
def terminal(monkeypatch):
    """A terminal ``columns`` wide as the data console; returns what was printed."""

    def make(columns: int):
        buffer = io.StringIO()
        monkeypatch.setattr(
            output, "console", DataConsole(file=buffer, force_terminal=True, width=columns, color_system=None)
        )
        return buffer

    return make


@pytest.mark.parametrize("columns", [80, 120], ids=["80", "120"])
def test_identifiers_are_never_split(terminal, columns):
    buffer = terminal(columns)
    rows = [
        [REF, "production", "2026-12-04 12:53", 8, "auto", "0.750", "0.611", "f82679dc0123", "118.0 MB"],
        ["acme/kvmap-support", "", "", 1, "0.1", "0.9", "0.8", "", "1.0 MB"],
    ]  # kvhub list's columns
    output.print_table(
        ["REF", "ALIASES", "CREATED", "K", "LAMBDA", "R2 K", "R2 V", "TEXT", "SIZE"],
        rows,
        right=("K", "LAMBDA", "R2 K", "R2 V", "SIZE"),
    )
    text = buffer.getvalue()
    for cell in (REF, "production", "2026-12-04 12:53", "acme/kvmap-support"):
        assert cell in text, text


def test_key_value_overview_keeps_values_whole(terminal):
    buffer = terminal(60)
    output.print_table(None, [["ref", REF], ["repository", "acme/kvmap-support"]])
    assert REF in buffer.getvalue()


def test_a_narrow_table_still_fits_the_terminal(terminal):
    buffer = terminal(80)
    output.print_table(["NAME", "K"], [["legal-docs", 8]])
    assert max(len(line) for line in buffer.getvalue().splitlines()) <= 80
