"""Map kinds: what a mapper computes on top of its linear (ridge) maps, declared once.

mapper.json's ``kind`` names one of :data:`MAP_KINDS`; an artifact without it is ``ridge``.  Per kind:

    kind    format  settings block    extra tensors per map prefix p = {k,v}.{m}
    ridge   1       -                 -
    mlp     4       "mlp": {width,    p.mlp.{i}.weight, p.mlp.{i}.bias for i = 0..depth:
                    depth,            (d_in, w), (w, w) x (depth - 1), (w, d_out); biases (w,) .. (d_out,)
                    activation}

An ``mlp`` map is y = x @ W + b + r(x), the ridge map plus a residual MLP on the same input x (the
selected source layers' RoPE-stripped K or V): h_0 = x, h_i = act(h_{i-1} @ A_i + c_i) for i = 1..depth
(width w), r = h_depth @ A_out + c_out (:mod:`kvhub.core.mlp`).  Its format version is 4, so kvhub
releases that read up to 3 refuse it with "upgrade kvhub"; a reader that meets a ``kind`` it does not
know refuses it by name (:func:`kind_of`), as does the format-version check of later readers.

A new kind is an entry here (its name, format version, settings and tensors), its forward pass in
``kvhub.core`` (registered in :data:`kvhub.core.mapper.RESIDUALS`) and its training in
``kvhub.fitting``.  Nothing here imports torch.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable

from kvhub.errors import FormatVersionError, InvalidArtifactError

DEFAULT_KIND = "ridge"
ACTIVATIONS = ("gelu", "relu")  # what kvhub.core.mlp implements
_MLP_PART = re.compile(r"mlp\.(0|[1-9][0-9]{0,2})\.(weight|bias)")
_KIND_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")  # how kinds are named: what a later kvhub could add
# The integer settings of an mlp map, inclusive bounds: mapper.json's ``mlp`` block and ``kvhub fit``'s
# --mlp-* options (kvhub.fitting.options) both take them from here.
MLP_INTEGERS = {
    "width": (1, 1 << 16),
    "depth": (1, 64),
    "epochs": (1, 1 << 20),
    "patience": (1, 1 << 20),
    "batch_size": (1, 1 << 31),
    "seed": (0, (1 << 63) - 1),
}
MLP_SPLITS = ("train", "heldout")  # the row reservoirs (``tokens``) and losses of each map


@dataclass(frozen=True)
class MapKind:
    """One kind of map.  ``format_version``: the lowest artifact format that holds it; ``block``: the
    mapper.json key of its settings (None: none); ``parts(settings, d_in, d_out)``: the extra tensors of one
    map, {part: shape}; ``check(settings, target_layers)``: (key, what is wrong) with its settings block, or
    None; ``output_parts(settings)``: the parts whose output adds to the linear map's (what de-shrinking
    scales)."""

    name: str
    format_version: int
    summary: str
    block: str | None = None
    parts: Callable[[dict, int, int], dict[str, tuple[int, ...]]] = lambda settings, d_in, d_out: {}
    check: Callable[[dict, int], tuple[str, str] | None] = lambda settings, target_layers: None
    part_pattern: re.Pattern | None = None
    output_parts: Callable[[dict], tuple[str, ...]] = lambda settings: ()  # scaled with the map (de-shrinking)

    def describe(self, settings: dict | None) -> str:
        """``ridge``, or ``ridge + residual MLP (2 x 256, gelu)``: the one wording of a kind (fit summary, card)."""
        if self.name == "mlp" and settings:
            return (
                f"ridge + residual MLP ({settings.get('depth')} x {settings.get('width')}, "
                f"{settings.get('activation')})"
            )
        return self.summary


def mlp_part(index: int, what: str) -> str:
    """``mlp.0.weight``: the part name of layer ``index`` of a map's residual MLP (``what``: weight or bias)."""
    return f"mlp.{index}.{what}"


def _mlp_parts(settings: dict, d_in: int, d_out: int) -> dict[str, tuple[int, ...]]:
    width, depth = settings["width"], settings["depth"]
    widths = [d_in] + [width] * depth + [d_out]  # layer i maps widths[i] -> widths[i + 1]
    parts: dict[str, tuple[int, ...]] = {}
    for i in range(depth + 1):
        parts[mlp_part(i, "weight")] = (widths[i], widths[i + 1])
        parts[mlp_part(i, "bias")] = (widths[i + 1],)
    return parts


def mlp_integer_problem(name: str, value) -> str | None:
    """What setting ``name`` of :data:`MLP_INTEGERS` must be ("an integer in 1..64"), or None when ``value`` is one."""
    low, high = MLP_INTEGERS[name]
    if isinstance(value, int) and not isinstance(value, bool) and low <= value <= high:
        return None
    return f"an integer in {low}..{high}"


def _check_mlp(settings: dict, target_layers: int) -> tuple[str, str] | None:
    """The ``mlp`` block: ``width``, ``depth``, ``activation`` (required: they shape the tensors); the training
    record when present (``epochs``, ``patience``, ``batch_size``, ``seed`` integers in range, ``lr`` a finite
    number > 0, ``tokens`` {train, heldout: row counts}, ``losses`` {k, v: {train, heldout: one finite MSE >= 0
    per target layer}}: the store keeps them, tables and JSON show them)."""
    for name in MLP_INTEGERS:
        value = settings.get(name)
        problem = mlp_integer_problem(name, value)
        if problem and (name in ("width", "depth") or value is not None):
            return name, f"must be {problem}, not {_shown(value)}"
    if settings.get("activation") not in ACTIVATIONS:
        return "activation", f"must be one of {', '.join(ACTIVATIONS)}, not {_shown(settings.get('activation'))}"
    lr = settings.get("lr")
    if lr is not None and not (_is_number(lr) and 0 < lr):
        return "lr", f"must be a finite number > 0, not {_shown(lr)}"
    tokens = settings.get("tokens")
    if tokens is not None and not (
        isinstance(tokens, dict)
        and set(tokens) <= set(MLP_SPLITS)
        and all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 1 << 62 for n in tokens.values())
    ):
        return "tokens", f"must be {{train, heldout: row counts}}, not {_shown(tokens)}"
    losses = settings.get("losses")
    return None if losses is None else _check_losses(losses, target_layers)


def _check_losses(losses, target_layers: int) -> tuple[str, str] | None:
    if not isinstance(losses, dict) or set(losses) != {"k", "v"}:
        return "losses", f"must be {{k, v: {{train, heldout: [one loss per target layer]}}}}, not {_shown(losses)}"
    for kind in ("k", "v"):
        splits = losses[kind]
        if not isinstance(splits, dict) or set(splits) != set(MLP_SPLITS):
            return f"losses.{kind}", f"must be {{train, heldout: [one loss per target layer]}}, not {_shown(splits)}"
        for split in MLP_SPLITS:
            values = splits[split]
            if not (
                isinstance(values, list)
                and len(values) == target_layers
                and all(_is_number(v) and v >= 0 for v in values)
            ):
                return (
                    f"losses.{kind}.{split}",
                    f"must be a list of {target_layers} finite numbers >= 0 (one per target layer), not "
                    f"{_shown(values)}",
                )
    return None


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


MAP_KINDS: dict[str, MapKind] = {
    "ridge": MapKind("ridge", 1, "ridge"),
    "mlp": MapKind(
        "mlp",
        4,
        "ridge + residual MLP",
        block="mlp",
        parts=_mlp_parts,
        check=_check_mlp,
        part_pattern=_MLP_PART,
        output_parts=lambda s: (mlp_part(s["depth"], "weight"), mlp_part(s["depth"], "bias")),
    ),
}


def kind_of(metadata: dict, *, where: str = "this artifact") -> MapKind:
    """The MapKind mapper.json names (``ridge`` when it names none); FormatVersionError naming the kind for
    one this kvhub does not know."""
    name = metadata.get("kind", DEFAULT_KIND)
    if name is None:
        name = DEFAULT_KIND
    if name not in MAP_KINDS and not (isinstance(name, str) and _KIND_NAME.fullmatch(name)):
        # "", "MLP", " mlp": no kvhub names a kind so, and no upgrade would read it
        near = [known for known in MAP_KINDS if isinstance(name, str) and name.strip().lower() == known]
        raise InvalidArtifactError(
            f"{where}: mapper.json field `kind` is {_shown(name)}, not the name of a map kind (kvhub knows "
            f"{', '.join(MAP_KINDS)}{f'; did you mean {near[0]!r}?' if near else ''}); the artifact is "
            "corrupt or was edited, re-fetch it or re-fit the mapper",
            field="kind",
        )
    if name not in MAP_KINDS:
        raise FormatVersionError(
            f"{where} holds a map of kind {name!r}, which this kvhub does not know (it knows "
            f"{', '.join(MAP_KINDS)}); upgrade with `pip install -U kvhub`"
        )
    return MAP_KINDS[name]


def is_kind_part(part: str) -> bool:
    """Whether ``part`` (``mlp.0.weight``) is a tensor part some kind declares."""
    return any(kind.part_pattern is not None and kind.part_pattern.fullmatch(part) for kind in MAP_KINDS.values())


def kind_of_part(part: str) -> MapKind | None:
    """The kind whose tensors include ``part``, None for the linear map's own parts."""
    return next(
        (kind for kind in MAP_KINDS.values() if kind.part_pattern is not None and kind.part_pattern.fullmatch(part)),
        None,
    )
