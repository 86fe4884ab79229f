"""Regenerate docs/cli.md from the click commands' own help (the docstrings are the manual).

.venv/bin/python scripts/gen_cli_docs.py > docs/cli.md
"""

import click

from kvhub.cli.main import main


def walk(command: click.Command, path: list[str], parent: click.Context | None = None):
    """(path, command, context) of every command; each context has its group's as parent, so the help
    shows what ``kvhub COMMAND -h`` shows (the group's settings: ``-h, --help``)."""
    ctx = click.Context(command, info_name=path[-1], parent=parent, **command.context_settings)
    yield path, command, ctx
    if isinstance(command, click.Group):
        for name in sorted(command.commands):
            yield from walk(command.commands[name], path + [name], ctx)


def render() -> str:
    lines = [
        "# kvhub command-line reference",
        "",
        "Generated from the commands' help by `scripts/gen_cli_docs.py`; `kvhub COMMAND -h` shows the same.",
        "",
    ]
    for path, command, ctx in walk(main, ["kvhub"]):
        lines += [f"## {' '.join(path)}", "", "```", command.get_help(ctx), "```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(render())
