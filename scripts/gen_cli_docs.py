"""Regenerate docs/cli.md from the click commands' own help (the docstrings are the manual).

    .venv/bin/python scripts/gen_cli_docs.py > docs/cli.md
"""

import click

from kvhub.cli.main import main


def walk(command: click.Command, path: list[str]):
    yield path, command
    if isinstance(command, click.Group):
        for name in sorted(command.commands):
            yield from walk(command.commands[name], path + [name])


def render() -> str:
    lines = ["# kvhub command-line reference", "",
             "Generated from the commands' help by `scripts/gen_cli_docs.py`; `kvhub COMMAND --help` shows the same.", ""]
    for path, command in walk(main, ["kvhub"]):
        with click.Context(command, info_name=" ".join(path)) as ctx:
            lines += [f"## {' '.join(path)}", "", "```", command.get_help(ctx), "```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(render())
