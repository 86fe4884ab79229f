"""Shared rich consoles: data to stdout, diagnostics and progress to stderr.

Off a terminal (a pipe, a file) stdout is as wide as what is printed: Rich would otherwise fold, wrap
or cut tables and lines at $COLUMNS or the width of whatever terminal stderr is on, and ``kvhub ... |
cat`` would lose cell text.

Text that carries names or messages from outside (model ids, references, error text, paths) is printed
with :func:`say` / :func:`plain`: never interpreted as Rich markup, so ``[/]`` in a model id cannot
crash a command and ``pip install 'kvhub[postgres]'`` keeps its brackets.
"""

from rich.console import Console, ConsoleDimensions
from rich.text import Text

_UNBOUNDED_WIDTH = 1_000_000  # wider than any table or line kvhub prints


class DataConsole(Console):
    """A Console with no width limit when its file is not a terminal (module docstring)."""

    @property
    def size(self) -> ConsoleDimensions:
        size = super().size
        return size if self.is_terminal else ConsoleDimensions(_UNBOUNDED_WIDTH, size.height)

    @size.setter
    def size(self, new_size) -> None:
        Console.size.fset(self, new_size)


console = DataConsole()
err_console = Console(stderr=True)


def plain(text) -> Text:
    """``text`` as a Rich renderable shown verbatim (for table cells)."""
    return Text(str(text))


def say(message: str, *, label: str | None = None, style: str | None = None, to=None) -> None:
    """Print ``message`` verbatim (stderr unless ``to``), after an optional styled ``label``."""
    line = Text.assemble((label, style or "") if label else "", " " if label else "", str(message))
    (to or err_console).print(line, highlight=False, soft_wrap=True)
