"""Data on stdout in one of three formats, the same for every command that lists things.

``--format table`` (the default) is for people: a Rich table on a terminal (cells never folded or
ellipsised: a table wider than the terminal runs past its edge), and on anything else (a pipe, a file) plain columns separated by two spaces, one row a
line, never wrapped or cut.  ``--format tsv`` is for ``cut``/``awk``: a header line, then one line a
row, tabs between cells (tabs and newlines inside a cell become spaces).  ``--format json`` (alias
``--json``) is for programs: the command's documented JSON, sorted keys.
"""

from __future__ import annotations

import functools
import json

import click

from kvhub.artifact.metadata import shown
from kvhub.cli.console import console, plain
from kvhub.eval.results import finite

FORMATS = ("table", "json", "tsv")


def format_option(command):
    """Add ``--format {table,json,tsv}`` and its alias ``--json``; the command receives ``output_format``."""

    @click.option(
        "--format",
        "output_format",
        type=click.Choice(FORMATS),
        default=None,
        help="Output: table (people; never wrapped when piped), json, or tsv.  [default: table]",
    )
    @click.option("--json", "as_json", is_flag=True, help="Same as --format json.")
    @functools.wraps(command)
    def wrapper(*args, output_format=None, as_json=False, **kwargs):
        if as_json and output_format not in (None, "json"):
            raise click.UsageError(f"--json and --format {output_format} contradict each other; pass one")
        return command(*args, output_format="json" if as_json else output_format or "table", **kwargs)

    return wrapper


def json_ref(version) -> str:
    """How every command's JSON names a mapper version: the full reference (``MapperVersion.ref``), never the
    short form tables show, so a script can hand it to any command against any store."""
    return version.ref


def version_json(version, metrics: list[dict] | None = None) -> dict:
    """The JSON of one version in the vocabulary the store commands share (kvhub.cli.store_cmd's docstring)."""
    data = version.to_dict()
    data["k"] = shown(data["k"])
    # one name for the knob, as --lambda, mapper.json, `kvhub fit --json` and `kvhub diff` spell it;
    # ridge_lambda, this JSON's former name, is kept for the scripts that read it
    data["lambda"] = data["ridge_lambda"] = shown(data["ridge_lambda"])
    if metrics is not None:
        data["metrics"] = metrics
    return data


def echo_json(data) -> None:
    """``data`` as indented JSON with sorted keys on stdout; NaN and infinities as null (strict JSON, whatever
    a store row or a file held)."""
    click.echo(json.dumps(finite(data), indent=2, sort_keys=True, default=str, allow_nan=False))


def print_record(data: dict, *, output_format: str) -> bool:
    """A command's one JSON document on stdout: as JSON, or for tsv its field names (sorted) over one row
    (lists and objects as compact JSON, booleans true/false, null an empty cell).  False for table: the
    caller says what happened in words."""
    if output_format == "json":
        echo_json(data)
        return True
    if output_format == "tsv":
        columns = sorted(data)
        for line in tsv_lines(columns, [[_json_cell(data[name]) for name in columns]]):
            click.echo(line)
        return True
    return False


def _json_cell(value):
    if isinstance(value, (bool, dict, list, tuple)):
        return json.dumps(finite(value), sort_keys=True, separators=(",", ":"), default=str, allow_nan=False)
    return finite(value)


def _cell(value) -> str:
    return "" if value is None else str(value)


def tsv_lines(columns: list[str], rows: list[list]) -> list[str]:
    """Header and rows as tab-separated lines (tabs and line breaks inside cells become spaces)."""

    def clean(value) -> str:
        return " ".join(_cell(value).replace("\t", " ").splitlines())

    return ["\t".join(columns)] + ["\t".join(clean(cell) for cell in row) for row in rows]


def plain_lines(columns: list[str] | None, rows: list[list], *, right: tuple[str, ...] = ()) -> list[str]:
    """Rows as columns padded to their widest cell, two spaces apart, trailing blanks stripped."""
    table = ([columns] if columns else []) + [[_cell(cell) for cell in row] for row in rows]
    if not table:
        return []
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    names = columns or [""] * len(widths)
    return [
        "  ".join(
            cell.rjust(width) if name in right else cell.ljust(width) for cell, width, name in zip(row, widths, names)
        ).rstrip()
        for row in table
    ]


def print_table(
    columns: list[str] | None,
    rows: list[list],
    *,
    output_format: str = "table",
    title: str | None = None,
    right: tuple[str, ...] = (),
) -> None:
    """Print rows as a table (``columns`` None: a headerless two-column overview) or as TSV.

    ``right``: the columns aligned right (numbers).  Cell text is always shown verbatim (no markup).
    """
    if output_format == "tsv":
        for line in tsv_lines(columns or ["field", "value"], rows):
            click.echo(line)
        return
    if not console.is_terminal:
        if title:
            click.echo(f"{title}:")
        for line in plain_lines(columns, rows, right=right):
            click.echo(line)
        return
    from rich.table import Table

    table = Table(box=None, header_style="bold", show_header=columns is not None, title=title, title_justify="left")
    for index, name in enumerate(columns or ["", ""]):
        overview_label = columns is None and index == 0
        table.add_column(
            name,
            overflow="fold",
            justify="right" if name in right else "left",
            style="bold" if overview_label else None,
            no_wrap=overview_label,
        )
    for row in rows:
        table.add_row(*(plain(_cell(cell)) for cell in row))
    _print_whole(table)


def _print_whole(table) -> None:
    """Print a Rich table whose cells are never folded: one that is wider than the terminal is laid out
    at its natural width and its lines run past the edge (as ``hf`` and ``mlflow`` print long ids), so a
    reference, a repository id or a task name is always one copyable string."""
    from rich.measure import Measurement

    natural = Measurement.get(console, console.options.update(max_width=1_000_000), table).maximum
    if natural <= console.width:
        console.print(table)
        return
    from rich.console import Console

    # Console.print(width=) never exceeds the console's width: a console as wide as the table, same file
    wide = Console(
        file=console.file,
        width=natural,
        force_terminal=True,
        color_system=console.color_system,
        no_color=console.no_color,
    )
    wide.print(table, crop=False)


def format_number(value, *, exact: bool = False) -> str:
    """The one way a number is shown: integers bare (256, never 256.0), others with three decimals
    (0.986, 1.000), nonzero magnitudes below 0.001 in e-notation (5.00e-04); ``exact`` (tsv, read by
    scripts) keeps every digit of a non-integer.  None is an empty cell."""
    if value is None:
        return ""
    number = float(value)
    if isinstance(value, int) or (number.is_integer() and abs(number) >= 2):
        return str(int(number))
    if exact:
        return repr(number)
    if number != 0 and abs(number) < 1e-3:
        return f"{number:.2e}"
    return f"{number:.3f}"


def format_size(num_bytes: float) -> str:
    """A byte count for people: 512 B, 1.5 KB, ... GB."""
    for unit in ("B", "KB", "MB", "GB"):
        if num_bytes < 1024 or unit == "GB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes} B"
