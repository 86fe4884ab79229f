"""Click options made from :class:`kvhub.fitting.options.FitOptions`' fields: each knob's flag, help, choices
and rule are declared there once; ``kvhub fit`` and ``kvhub plan`` take them from here."""

from __future__ import annotations

import functools

import click
from click.core import ParameterSource

from kvhub.fitting.options import AUTO, MLP_KNOBS, auto_or, check_mlp_knobs, knob_field, what_to_use


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
    """A decorator adding the click options of the knobs ``names``, in that order.  With ``map_kind`` among
    them, an --mlp-* option of ``names`` given without ``--map mlp`` is refused (even at its default value)."""

    def decorate(command):
        mlp_names = [name for name in names if name in MLP_KNOBS]
        if "map_kind" in names and mlp_names:
            command = _mlp_options_need_mlp(command, mlp_names)
        for name in reversed(names):
            command = fit_option(name)(command)
        return command

    return decorate


def _mlp_options_need_mlp(command, names: list[str]):
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        context = click.get_current_context()
        given = [name for name in names if context.get_parameter_source(name) not in (None, ParameterSource.DEFAULT)]
        check_mlp_knobs(kwargs["map_kind"], given)
        return command(*args, **kwargs)

    return wrapper
