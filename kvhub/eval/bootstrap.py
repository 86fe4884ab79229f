"""Bootstrap 95% intervals over items: one helper for every summary that resamples its items."""

from __future__ import annotations

import math
import random


def with_intervals(stats, n: int, *, seed: int = 0, resamples: int = 1000) -> dict:
    """``stats(range(n))`` (a dict of numbers over items 0..n-1) and, for each key, ``<key>_ci``: its bootstrap
    95% interval, the 2.5% and 97.5% quantiles of ``stats`` over ``resamples`` resamples of the items with
    replacement (every key from the same resamples: paired; NaN resamples left out)."""
    rng = random.Random(seed)
    point = stats(range(n))
    boot = [stats([rng.randrange(n) for _ in range(n)]) for _ in range(resamples)]
    out = {}
    for key, value in point.items():
        values = sorted(b[key] for b in boot if not math.isnan(b[key]))
        out[key] = value
        out[f"{key}_ci"] = (
            [values[int(0.025 * len(values))], values[int(0.975 * len(values)) - 1]] if values else [math.nan, math.nan]
        )
    return out
