"""Options more than one command family shares: ``--db`` and the store it names, and REF_HELP, the epilog of
the commands that take a reference; the results document's ``--output-path`` and ``--log-samples``
(``kvhub eval``, ``kvhub eval-serve``); ``--dtype`` of the commands that run both models (fit, eval, bench) and
the dtype it leaves to this machine (:func:`chosen_dtype`)."""

from __future__ import annotations

from pathlib import Path

import click

DB_HELP = (
    "Store URL or SQLite path (default: $KVHUB_DB_URL, else $KVHUB_HOME/kvhub.db, else the user data "
    "dir). Commands that only read refuse a path where no store exists."
)

db_option = click.option("--db", default=None, metavar="URL", help=DB_HELP)

REF_HELP = """\b
REF is SRC:DST[:CALIB][@SELECTOR]:
  SRC, DST  model id (Qwen/Qwen2.5-Coder-0.5B-Instruct) or short name (qwen2.5-coder-0.5b-instruct)
  CALIB     calibration set; optional when the pair has one
  SELECTOR  v3 (a version), latest, production, or any alias; default: production if set, else latest"""


def open_db(db: str | None, *, create: bool = True):
    """The store ``--db`` names (kvhub.store.open_store, imported only when a command runs); ``create=False``
    for commands that only read, so a mistyped --db is refused instead of becoming a new empty store."""
    from kvhub.store import open_store

    return open_store(db, create=create)


def output_path_option(directory: str):
    """``--output-path``; ``directory``: what a directory PATH gets (the results file under it)."""
    return click.option(
        "--output-path",
        "--out",
        "output_path",
        type=click.Path(path_type=Path),
        default=None,
        metavar="PATH",
        help="Also write the results document: PATH ending in .json is the file, else a directory "
        f"that gets {directory}.  --out is the same option (fit's and report's name).",
    )


def log_samples_option(record: str):
    """``--log-samples``; ``record``: what one item's record holds."""
    return click.option(
        "--log-samples",
        is_flag=True,
        help=f"With --output-path: write every item's record ({record}) to samples_<task>_<date>.jsonl "
        "beside the results.",
    )


def one_value(argument_value, option_value, *, what: str, argument: str, option: str):
    """The value given as an argument or as an option (one of them, or both alike; commands name one thing
    alike across commands: --repo, --out); UsageError otherwise."""
    if argument_value and option_value and argument_value != option_value:
        raise click.UsageError(f"{argument} {argument_value} and {option} {option_value} name two; give {what} once")
    if not (argument_value or option_value):
        raise click.UsageError(f"give {what}: {argument} or {option}")
    return argument_value or option_value


def dtype_option(help_text: str):
    """``--dtype``, default None: :func:`chosen_dtype` picks it for the device."""
    return click.option(
        "--dtype",
        default=None,
        help=f"{help_text} [default: bfloat16; float32 on a CPU that emulates bf16 (no avx512_bf16/amx_bf16 "
        "in /proc/cpuinfo), with a note saying so].",
    )


def chosen_dtype(dtype: str | None, device: str | None, *, quiet: bool = False) -> str:
    """``--dtype`` as given, else the one the forward passes on ``device`` run fastest in
    (:func:`kvhub.dtypes.default_dtype`), whose note (a CPU that emulates bf16) is said on stderr unless ``quiet``."""
    if dtype is not None:
        return dtype
    from kvhub.cli.console import say
    from kvhub.dtypes import default_dtype

    dtype, note = default_dtype(device)
    if note and not quiet:
        say(note, label="note:")
    return dtype
