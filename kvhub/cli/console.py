"""Shared rich consoles: data to stdout, diagnostics and progress to stderr.

Text that carries names or messages from outside (model ids, references, error text, paths) is printed
with :func:`say` / :func:`plain`: never interpreted as Rich markup, so ``[/]`` in a model id cannot
crash a command and ``pip install 'kvhub[postgres]'`` keeps its brackets.
"""

from rich.console import Console
from rich.text import Text

console = Console()
err_console = Console(stderr=True)


def plain(text) -> Text:
    """``text`` as a Rich renderable shown verbatim (for table cells)."""
    return Text(str(text))


def say(message: str, *, label: str | None = None, style: str | None = None, to=None) -> None:
    """Print ``message`` verbatim (stderr unless ``to``), after an optional styled ``label``."""
    line = Text.assemble((label, style or "") if label else "", " " if label else "", str(message))
    (to or err_console).print(line, highlight=False, soft_wrap=True)
