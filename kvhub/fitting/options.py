"""The knobs of a fit, declared once: :class:`FitOptions`.

Each knob is a field with its command-line flag, help and rule.  ``kvhub fit`` and ``kvhub plan`` build
their options from these fields (:mod:`kvhub.cli.fit_options`); mapper.json's ``fit`` block is
:meth:`FitOptions.fit_block`; a value a rule refuses is refused when the options are made, before any
model loads (``FitOptions(ridge_lambda=-1)`` raises ConfigError naming ``--lambda``).

"auto": ``top_k`` and ``ridge_lambda`` None mean "chosen per target layer on held-out R^2"
(:func:`kvhub.core.solve.solve`), in Python, in the store's columns and in mapper.json (null).  The word
``"auto"`` is only text: what a user types (:func:`auto_or`) and what a table shows
(:func:`kvhub.artifact.metadata.shown`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kvhub.artifact.kinds import DEFAULT_KIND, MAP_KINDS, mlp_integer_problem
from kvhub.errors import ConfigError
from kvhub.fitting.modes import CAPTURES, MODES, TARGET_LAYOUTS, StatisticsMode

AUTO = "auto"  # the text for None in top_k / ridge_lambda
DEFAULT_STRIDE = 4  # the paper's token stride, when neither the options nor a calibration recipe give one
WEIGHTINGS = ("uniform", "attention")
MIN_MLP_ROWS = 2  # rows per split an MLP fit keeps at least: a held-out R^2 over one row is undefined


def auto_or(text, convert: Callable):
    """``text`` as a knob value: None for "auto" (or None), else ``convert(text)``; ValueError when it is neither."""
    if text is None or text == AUTO:
        return None
    if isinstance(text, str):
        return convert(text.strip())
    return text


# ---- rules: each returns what a value must be, or None when it is one -----------------------------------
def _positive_integer(value) -> str | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    return None if ok else "a positive integer"


def _non_negative_integer(value) -> str | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return None if ok else "a non-negative integer"


def _non_negative_number(value) -> str | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    return None if ok else "a finite non-negative number"


def _positive_number(value) -> str | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    return None if ok else "a finite positive number"


def _mlp_setting(name: str) -> Callable:
    """The rule of an mlp setting: the bounds mapper.json's ``mlp`` block holds it to (kvhub.artifact.kinds), so a
    fit is never refused only when its artifact is written."""

    def rule(value) -> str | None:
        return mlp_integer_problem(name, value)

    return rule


def _mlp_rows(value) -> str | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= MIN_MLP_ROWS
    return None if ok else f"an integer of at least {MIN_MLP_ROWS} (an R^2 needs two rows per split)"


def _flag(value) -> str | None:
    return None if isinstance(value, bool) else "True or False"


def _one_of(choices: tuple[str, ...]) -> Callable:
    def rule(value) -> str | None:
        return None if value in choices else "one of " + ", ".join(choices)

    return rule


def _mode(value) -> str | None:
    return None if isinstance(value, StatisticsMode) or value in MODES else "one of " + ", ".join(MODES)


def knob(
    default,
    *,
    flag: str | None,
    help: str,
    rule: Callable,
    parse: Callable | None = None,
    auto: bool = False,
    choices: tuple[str, ...] | None = None,
    in_fit_block: bool = False,
):
    """A FitOptions field.  flag: its command-line option (None: Python only); parse: text -> value for the
    command line; auto: None is spelled "auto"; choices: the values the command line offers; in_fit_block:
    recorded in mapper.json's ``fit`` block."""
    return field(
        default=default,
        metadata={
            "flag": flag,
            "help": help,
            "rule": rule,
            "parse": parse,
            "auto": auto,
            "choices": choices,
            "in_fit_block": in_fit_block,
        },
    )


@dataclass
class FitOptions:
    """The knobs of a fit (each field's metadata: flag, help, rule).  The last three fields are where one run
    keeps its state, not knobs: the checkpoint file, how often it is written, and the timings."""

    top_k: int | None = knob(
        None,
        flag="--k",
        parse=int,
        auto=True,
        rule=_positive_integer,
        help="Source layers per target layer, or 'auto' (chosen per layer on held-out R^2).",
    )
    ridge_lambda: float | None = knob(
        None,
        flag="--lambda",
        parse=float,
        auto=True,
        rule=_non_negative_number,
        help="Ridge strength relative to the mean Gram diagonal, or 'auto' (chosen per layer on held-out R^2).",
    )
    stride: int | None = knob(
        None,
        flag="--stride",
        parse=int,
        rule=_positive_integer,
        in_fit_block=True,
        help="Keep every s-th token for the statistics [default: the calibration recipe's; paper: 4].",
    )
    batch_size: int = knob(
        4, flag="--batch-size", parse=int, rule=_positive_integer, in_fit_block=True, help="Sequences per forward pass."
    )
    weighting: str = knob(
        "uniform",
        flag="--weighting",
        choices=WEIGHTINGS,
        rule=_one_of(WEIGHTINGS),
        in_fit_block=True,
        help="How much each calibration token counts in the fit: 'uniform', or 'attention' = by the attention the "
        "target model pays it (capped at 10x uniform, against attention sinks). 'attention' runs the target's "
        "forward passes with eager attention, which is slower and needs more memory.",
    )
    weight_cap: float = knob(
        10.0,
        flag=None,
        rule=_positive_number,
        in_fit_block=True,
        help="Cap of a token's attention weight, in multiples of uniform.",
    )
    head_local: bool = knob(
        False,
        flag="--head-local",
        rule=_flag,
        help="Compressed maps: each target KV head group reads only its source head group (gcd of the KV head "
        "counts groups; that many times fewer weights).",
    )
    rank: int | None = knob(
        None,
        flag="--rank",
        parse=int,
        rule=_positive_integer,
        help="Compressed maps: reduced-rank ridge of this rank per target layer (and head group).",
    )
    skip_first: int = knob(
        0,
        flag=None,
        rule=_non_negative_integer,
        in_fit_block=True,
        help="Tokens at the start of each sequence left out of the statistics.",
    )
    statistics: str | StatisticsMode = knob(
        "auto",
        flag="--stats",
        choices=MODES,
        rule=_mode,
        help="How the statistics are accumulated: 'one-pass' (every source layer's full statistics), 'two-pass' "
        "(a probe pass over per-layer blocks picks candidate source layers, a second pass keeps only those: "
        "for pairs whose full statistics do not fit), or 'auto' (what kvhub plan says fits the memory free now).",
    )
    candidates: int | None = knob(
        None,
        flag="--candidates",
        parse=int,
        rule=_positive_integer,
        help="Two-pass statistics: the most source layers pass 2 keeps (per process) [default: as many as the "
        "plan fits].",
    )
    capture: str = knob(
        "auto",
        flag="--capture",
        choices=CAPTURES,
        rule=_one_of(CAPTURES),
        help="Where the models run: 'one-phase' (source and target side by side, both resident), 'two-phase' (the "
        "source alone first, its captures spooled to disk under the kvhub cache, then the target alone: one "
        "model resident at a time, the same statistics), or 'auto' (what kvhub plan says fits the memory free now).",
    )
    target_layout: str = knob(
        "auto",
        flag="--target-layout",
        choices=TARGET_LAYOUTS,
        rule=_one_of(TARGET_LAYOUTS),
        help="How the target runs: 'whole' (the model on the device), 'layer-outer' (its weights on the host, each "
        "decoder layer onloaded once and every batch run through it, hidden states carried between layers: for a "
        "target larger than one device; implies two-phase capture, one-pass statistics, ridge maps), or 'auto' "
        "(what kvhub plan says fits).",
    )
    map_kind: str = knob(
        DEFAULT_KIND,
        flag="--map",
        choices=tuple(MAP_KINDS),
        rule=_one_of(tuple(MAP_KINDS)),
        help="Map kind: 'ridge' (the closed-form linear map), or 'mlp' = that map plus a residual MLP per target "
        "layer and K/V, trained on sampled calibration rows with early stopping on the held-out ones (for "
        "pairs where ridge's held-out R^2 stays low; slower, see docs/guide.md).",
    )
    mlp_width: int = knob(
        256,
        flag="--mlp-width",
        parse=int,
        rule=_mlp_setting("width"),
        help="--map mlp: width of the residual MLP's hidden layers.",
    )
    mlp_depth: int = knob(
        2,
        flag="--mlp-depth",
        parse=int,
        rule=_mlp_setting("depth"),
        help="--map mlp: hidden layers of the residual MLP.",
    )
    mlp_tokens: int = knob(
        8192,
        flag="--mlp-tokens",
        parse=int,
        rule=_mlp_rows,
        help="--map mlp: calibration rows (tokens) per split kept to train the MLPs on, evenly spread; memory "
        "grows with it (4 bytes x tokens x every layer's K and V width, both models).",
    )
    mlp_epochs: int = knob(
        100,
        flag="--mlp-epochs",
        parse=int,
        rule=_mlp_setting("epochs"),
        help="--map mlp: most epochs per MLP (early stopping usually ends sooner).",
    )
    mlp_seed: int = knob(0, flag=None, rule=_mlp_setting("seed"), help="--map mlp: seed of the MLPs' training.")

    checkpoint: Path | None = None
    checkpoint_every: int = 4
    timings: dict = field(default_factory=dict)

    def __post_init__(self):
        for spec in knobs():
            value = getattr(self, spec.name)
            if spec.metadata["auto"] and value == AUTO:
                setattr(self, spec.name, value := None)
            problem = check(spec.name, value)
            if problem:
                raise ConfigError(problem)
        check_mlp_knobs(self.map_kind, [spec.name for spec in knobs() if _changed_mlp_knob(self, spec)])
        if self.candidates is not None and (
            self.statistics == "one-pass" or isinstance(self.statistics, StatisticsMode)
        ):
            raise ConfigError(
                "--candidates sets what a two-pass fit's second pass keeps; drop it or use --stats "
                "two-pass (a StatisticsMode carries its own)"
            )

    def fit_block(self) -> dict:
        """The knobs mapper.json records under ``fit`` (k and lambda are top-level; head_local and rank are
        the ``structure`` block; the statistics mode is the one the fit ran)."""
        return {spec.name: getattr(self, spec.name) for spec in knobs() if spec.metadata["in_fit_block"]}

    def replace(self, **changes) -> "FitOptions":
        return dataclasses.replace(self, **changes)


MLP_KNOBS = ("mlp_width", "mlp_depth", "mlp_tokens", "mlp_epochs", "mlp_seed")  # what only --map mlp reads


def _changed_mlp_knob(options: FitOptions, spec: dataclasses.Field) -> bool:
    return spec.name in MLP_KNOBS and getattr(options, spec.name) != spec.default


def check_mlp_knobs(map_kind: str, given: list[str]) -> None:
    """ConfigError naming the --mlp-* options ``given`` (knob names) when the map kind trains no MLP: they would
    be ignored without a word (as --candidates is refused without two-pass statistics)."""
    if given and MAP_KINDS[map_kind].block != "mlp":
        flags = ", ".join(knob_field(name).metadata["flag"] or f"{name}=" for name in given)
        raise ConfigError(
            f"{flags} set{'s' if len(given) == 1 else ''} the residual MLP of --map mlp; "
            f"add --map mlp, or drop {'it' if len(given) == 1 else 'them'} for a {map_kind} fit"
        )


def knobs() -> list[dataclasses.Field]:
    """FitOptions' knob fields, in declaration order."""
    return [spec for spec in dataclasses.fields(FitOptions) if "rule" in spec.metadata]


def knob_field(name: str) -> dataclasses.Field:
    return next(spec for spec in knobs() if spec.name == name)


def what_to_use(name: str, value) -> str | None:
    """``use ...``: what knob ``name`` takes, when ``value`` is not one of those; None when it is."""
    spec = knob_field(name)
    if value is None and spec.default is None:
        return None
    must = spec.metadata["rule"](value)
    if must is None:
        return None
    return f"use {must}{' or ' + repr(AUTO) if spec.metadata['auto'] else ''}"


def check(name: str, value) -> str | None:
    """Why ``value`` cannot be knob ``name`` (a sentence naming the flag and what to use), or None."""
    use = what_to_use(name, value)
    if use is None:
        return None
    flag = knob_field(name).metadata["flag"]  # raised in Python: the keyword first, then kvhub fit's flag
    return f"{name}={value!r}{f' (kvhub fit {flag})' if flag else ''}: {use}"
