"""Every kvhub command written in the documentation parses as written (ux-3 U3-1, U3-13): the examples
in each command's help (which docs/cli.md reproduces) and the shell blocks of README.md and docs/*.md.

A documented command *shape* is checked by click's own parser, down the group to the command, with the
options' callbacks run: an example run together with the next one ("unexpected extra argument"), a
comment that swallows a line continuation, or an option the command lacks fails here.  Running them
for real is the walkthrough's job (tests/contracts/test_walkthrough.py)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from kvhub.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def walk(command: click.Command, path: list[str]):
    yield path, command
    if isinstance(command, click.Group):
        for name in sorted(command.commands):
            yield from walk(command.commands[name], path + [name])


def help_text(path: list[str], command: click.Command) -> str:
    """What ``kvhub ... -h`` prints, up to its option list (the examples live in the docstring)."""
    parent = None
    for depth in range(1, len(path)):  # the parents' contexts carry -h as a help option
        group = main if depth == 1 else parent.command.commands[path[depth - 1]]
        parent = click.Context(group, info_name=path[depth - 1], parent=parent, **group.context_settings)
    # with the command's own settings, as `kvhub` makes its contexts: click caches a command's help option
    # the first time it is asked for it, so a context without kvhub's -h would take -h from every later test
    ctx = click.Context(command, info_name=path[-1], parent=parent, **command.context_settings)
    return command.get_help(ctx).split("\nOptions:", 1)[0]


def command_lines(text: str) -> list[str]:
    """Shell lines that start with ``kvhub``: continuations joined, a comment or a trailing
    parenthetical note dropped, a pipe cut off.  A line continued with ``\\`` must really continue: a
    backslash followed by anything but the newline is kept, and the shell would split there too."""
    lines, pending = [], None
    for raw in text.splitlines():
        line = raw.strip()
        if pending is not None:
            line = pending + " " + line
            pending = None
        elif not line.startswith("kvhub ") and line != "kvhub":
            continue
        if raw.rstrip().endswith("\\"):
            pending = line[:-1]
            continue
        lines.append(line)
    return lines


def shell_commands(line: str) -> list[list[str]]:
    """The kvhub argument lists of one documented line: ``;`` separates commands, a pipe or a redirect
    ends one, ``<what you typed>`` stands for one word, and ``~`` is expanded as the shell would."""
    line = re.sub(r"\s{2,}\(.*\)$", "", line)  # `kvhub show ...@v3 --layers     (what it shows)`
    line = re.sub(r"<[^<>]*>", "PLACEHOLDER", line)
    commands = []
    for part in line.split(";"):
        words = shlex.split(part, comments=True)
        if not words or words[0] != "kvhub":
            continue
        for stop in ("|", ">", "2>"):
            if stop in words:
                words = words[: words.index(stop)]
        commands.append([str(Path(w).expanduser()) if w.startswith("~/") else w for w in words[1:]])
    return commands


def synopsis(words: list[str]) -> tuple[list[str], list[str]]:
    """A usage synopsis (``kvhub gc [--dry-run] [--json]``) as (the words outside brackets, the options
    named inside them): the first must parse, the others must exist on the command."""
    text, optional = " ".join(words), []
    while "[" in text:
        inner = re.search(r"\[[^\[\]]*\]", text)
        if inner is None:
            break
        optional += re.findall(r"--[\w-]+", inner.group())
        text = text[: inner.start()] + text[inner.end() :]
    return text.split(), optional


def parse(args: list[str]) -> click.Command:
    """Parse ``kvhub ARGS`` the way ``main`` would, without running the command; returns the command."""
    command, name, parent = main, "kvhub", None
    while True:
        try:
            ctx = command.make_context(name, list(args), parent=parent)
        except click.exceptions.Exit:  # -h / --version
            return command
        if not isinstance(command, click.Group):
            return command
        rest = [*ctx._protected_args, *ctx.args]
        if not rest:
            return command
        name, command, args = command.resolve_command(ctx, rest)
        parent = ctx


def help_examples():
    for path, command in walk(main, ["kvhub"]):
        for line in command_lines(help_text(path, command)):
            yield pytest.param(line, id=f"{' '.join(path)}: {line[:60]}")


def markdown_examples():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for path in files:
        if path.name == "cli.md":  # the help text, checked above
            continue
        in_fence = False
        block: list[str] = []
        for raw in path.read_text().splitlines():
            if raw.startswith("```"):
                if in_fence:
                    for line in command_lines("\n".join(block)):
                        yield pytest.param(line, id=f"{path.name}: {line[:60]}")
                in_fence, block = not in_fence, []
            elif in_fence:
                block.append(raw)


def check_documented(line: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    for words in shell_commands(line):
        assert "kvhub" not in words, f"two commands run together on one line: {line!r}"
        required, optional = synopsis(words)
        if required[:1] == ["import"]:  # its DIR must exist: make the folder the example names
            for word in required[1:]:
                if not word.startswith("-"):
                    Path(word).mkdir(parents=True, exist_ok=True)
        command = parse(required)
        known = {opt for param in command.params for opt in getattr(param, "opts", [])}
        assert not set(optional) - known, f"kvhub {' '.join(required[:2])} has no {sorted(set(optional) - known)}"


@pytest.mark.parametrize("line", list(help_examples()))
def test_help_examples_parse(line, tmp_path, monkeypatch):
    check_documented(line, tmp_path, monkeypatch)


@pytest.mark.parametrize("line", list(markdown_examples()))
def test_markdown_commands_parse(line, tmp_path, monkeypatch):
    check_documented(line, tmp_path, monkeypatch)


def test_cli_reference_is_the_help():
    """docs/cli.md shows each command's examples as -h does, and -h beside --help."""
    text = (ROOT / "docs" / "cli.md").read_text()
    for path, command in walk(main, ["kvhub"]):
        section = text.split(f"## {' '.join(path)}\n", 1)[1].split("\n## ", 1)[0]
        assert "-h, --help" in section, f"docs/cli.md shows no -h for {' '.join(path)}: run scripts/gen_cli_docs.py"
        assert help_text(path, command) in section, (
            f"docs/cli.md's {' '.join(path)} is not its -h: run scripts/gen_cli_docs.py"
        )
