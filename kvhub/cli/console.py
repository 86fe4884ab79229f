"""Shared rich consoles: data to stdout, diagnostics and progress to stderr."""

from rich.console import Console

console = Console()
err_console = Console(stderr=True)
