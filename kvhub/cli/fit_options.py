"""Click options made from :class:`kvhub.fitting.options.FitOptions`' fields: each knob's flag, help, choices
and rule are declared there once; ``kvhub fit`` and ``kvhub plan`` take them from here."""

from __future__ import annotations

import click

from kvhub.fitting.options import AUTO, auto_or, knob_field, what_to_use


def _callback(name: str):
    """Parse the text (``auto`` -> None for k and lambda) and apply the knob's rule: a bad value is a usage
    error naming the option, before anything loads."""
    spec = knob_field(name)
    parse = spec.metadata["parse"]

    def callback(ctx, param, value):
        if isinstance(value, str) and parse is not None:
            try:
                value = auto_or(value, parse) if spec.metadata["auto"] else parse(value.strip())
            except ValueError:
                pass  # still text: the rule refuses it below
        use = what_to_use(name, value)
        if use:
            raise click.BadParameter(use)
        return value

    return callback


def fit_option(name: str, *, help: str | None = None):
    """The click option of knob ``name`` (its flag, default, help; ``help`` replaces the knob's own)."""
    spec = knob_field(name)
    meta = spec.metadata
    text = help or meta["help"]
    if meta["flag"] is None:
        raise ValueError(f"{name} has no command-line flag")
    if isinstance(spec.default, bool):
        return click.option(meta["flag"], name, is_flag=True, default=spec.default, help=text)
    if meta["choices"]:
        return click.option(
            meta["flag"],
            name,
            type=click.Choice(list(meta["choices"])),
            default=spec.default,
            show_default=True,
            help=text,
        )
    default = AUTO if meta["auto"] else spec.default
    metavar = {int: "INTEGER", float: "NUMBER"}[meta["parse"]] + ("|auto" if meta["auto"] else "")
    return click.option(
        meta["flag"],
        name,
        default=default,
        show_default=default is not None,
        metavar=metavar,
        callback=_callback(name),
        help=text,
    )


def fit_options(*names: str):
    """A decorator adding the click options of the knobs ``names``, in that order."""

    def decorate(command):
        for name in reversed(names):
            command = fit_option(name)(command)
        return command

    return decorate
