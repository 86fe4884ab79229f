"""Named calibration sets: recipes (registry/calibration/*.toml) -> token sequences for a fit.

    calibration_set = resolve_calibration("legal-docs", tokenizer=tok, tokenizer_id="Qwen/Qwen2.5-Coder-0.5B-Instruct")
    calibration_set.train      # (N, T) int64, calibration_set.heldout (M, T) int64
    calibration_set.to_metadata()  # -> mapper.json["calibration"]

See docs/calibration.md for the catalog, the recipe format and what the content hash covers.
"""

from kvhub.calib.recipe import (
    DEFAULT_CALIBRATION,
    Recipe,
    heldout_count,
    list_calibration_sets,
    load_recipe,
    recipe_from_spec,
)

# Building a set tokenizes and packs with torch: those names load on first use, so importing the recipes
# (kvhub.calib.recipe, or this package) stays torch-free.
_LAZY = {
    name: "kvhub.calib.calibration_set"
    for name in ("CalibrationSet", "fetch_corpus", "resolve_calibration", "source_status")
}

__all__ = [
    "DEFAULT_CALIBRATION",
    "CalibrationSet",
    "Recipe",
    "fetch_corpus",
    "heldout_count",
    "list_calibration_sets",
    "load_recipe",
    "recipe_from_spec",
    "resolve_calibration",
    "source_status",
]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
