"""Named calibration sets: recipes (registry/calibration/*.toml) -> token sequences for a fit.

    calibration_set = resolve_calibration("legal-docs", tokenizer=tok, tokenizer_id="Qwen/Qwen2.5-Coder-0.5B-Instruct")
    calibration_set.train      # (N, T) int64, calibration_set.heldout (M, T) int64
    calibration_set.to_metadata()  # -> mapper.json["calibration"]

See docs/calibration.md for the catalog, the recipe format and what the content hash covers.
"""

from kvhub.calib.calibration_set import CalibrationSet, fetch_corpus, resolve_calibration, source_status
from kvhub.calib.corpus import cache_root
from kvhub.calib.recipe import Recipe, heldout_count, list_calibration_sets, load_recipe, recipe_from_spec

__all__ = [
    "CalibrationSet",
    "Recipe",
    "cache_root",
    "fetch_corpus",
    "heldout_count",
    "list_calibration_sets",
    "load_recipe",
    "recipe_from_spec",
    "resolve_calibration",
    "source_status",
]
