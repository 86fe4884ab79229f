"""How transfer reads the fitted maps: as fitted, or de-shrunk (torch-free, so the CLI can offer the choices).

A ridge prediction varies about R^2 times as much as its target around the calibration mean, so mapped keys
are less distinct from each other than the target's own and attention over them is flatter.  De-shrinking
predicts mean + (prediction - mean) / sqrt(R^2) per target layer instead (s = 1/sqrt(max(R^2, 0.25)); mean =
the calibration mean of the target's RoPE-stripped K/V, the ``target_mean`` tensors of artifact format 3),
for keys and values ("kv"), values only ("v"), or not at all ("off").  The no-information control (the mean)
is unchanged by it.  :class:`kvhub.core.mapper.Mapper` applies it; docs/benchmarks.md section 5 has the
evidence for the default.
"""

from __future__ import annotations

from kvhub.artifact import map_prefix, tensor_name
from kvhub.env import deshrink_override
from kvhub.errors import ConfigError

DESHRINK = ("kv", "v", "off")
DESHRINK_DEFAULT = "kv"


def check_deshrink(value, *, what: str = "deshrink") -> str | None:
    """``value`` when it is one of :data:`DESHRINK` or None, else ConfigError naming ``what`` (the option, key or
    variable the value came from) and the choices."""
    if value is not None and value not in DESHRINK:
        raise ConfigError(
            f"{what}={value!r}: use one of {', '.join(DESHRINK)} ('kv': keys and values, 'v': values "
            "only, 'off': the maps as fitted)"
        )
    return value


def deshrink_setting(value: str | None, tensors, layers: list[dict]) -> str:
    """The setting a mapper of these tensors (names suffice) transfers with: ``value`` checked (ConfigError for
    an unknown one, or for "kv"/"v" on a mapper without target_mean tensors), or for None the default where
    the artifact allows it: ``$KVHUB_DESHRINK`` when set (how benchmarks measured before this default
    reproduce: ``KVHUB_DESHRINK=off``), else DESHRINK_DEFAULT, and "off" without target_mean tensors
    (older artifacts map as fitted)."""
    has_means = all(
        tensor_name(map_prefix(kind, layer["target"]), "target_mean") in tensors for layer in layers for kind in "kv"
    )
    if value is None:
        chosen = check_deshrink(deshrink_override(), what="KVHUB_DESHRINK") or DESHRINK_DEFAULT
        return chosen if has_means else "off"
    check_deshrink(value)
    if value != "off" and not has_means:
        raise ConfigError(
            f"deshrink={value!r} needs the calibration mean of the target's K/V (target_mean "
            "tensors, written by fits of artifact format 3); refit this mapper, or use deshrink='off'"
        )
    return value
