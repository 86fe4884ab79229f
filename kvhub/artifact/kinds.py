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

import re
from dataclasses import dataclass
from typing import Callable

from kvhub.errors import FormatVersionError

DEFAULT_KIND = "ridge"
ACTIVATIONS = ("gelu", "relu")  # what kvhub.core.mlp implements
_MLP_PART = re.compile(r"mlp\.(0|[1-9][0-9]{0,2})\.(weight|bias)")


@dataclass(frozen=True)
class MapKind:
    """One kind of map.  ``format_version``: the lowest artifact format that holds it; ``block``: the
    mapper.json key of its settings (None: none); ``parts(settings, d_in, d_out)``: the extra tensors of one
    map, {part: shape}; ``check(settings)``: (key, what is wrong) with its settings block, or None;
    ``output_parts(settings)``: the parts whose output adds to the linear map's (what de-shrinking scales)."""

    name: str
    format_version: int
    summary: str
    block: str | None = None
    parts: Callable[[dict, int, int], dict[str, tuple[int, ...]]] = lambda settings, d_in, d_out: {}
    check: Callable[[dict], tuple[str, str] | None] = lambda settings: None
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


def _check_mlp(settings: dict) -> tuple[str, str] | None:
    width, depth, activation = settings.get("width"), settings.get("depth"), settings.get("activation")
    if not (isinstance(width, int) and not isinstance(width, bool) and 1 <= width <= 1 << 16):
        return "width", f"must be an integer in 1..65536, not {width!r}"
    if not (isinstance(depth, int) and not isinstance(depth, bool) and 1 <= depth <= 64):
        return "depth", f"must be an integer in 1..64, not {depth!r}"
    if activation not in ACTIVATIONS:
        return "activation", f"must be one of {', '.join(ACTIVATIONS)}, not {activation!r}"
    return None


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
    if name not in MAP_KINDS:
        shown = name if isinstance(name, str) and len(name) <= 64 else str(name)[:64]
        raise FormatVersionError(
            f"{where} holds a map of kind {shown!r}, which this kvhub does not know (it knows "
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
