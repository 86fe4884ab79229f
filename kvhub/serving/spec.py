"""The recompute spec: which context tokens the target recomputes exactly over a mapped cache.

One type, :class:`Recompute`, carries it everywhere (``kvhub.handoff``, ``kvhub eval``, ``kvhub bench``,
lm-eval's model_args, the vLLM connector's ``kv_connector_extra_config`` and ``kvhub serve``); its field
names are the words users type (``exact_prefix``, ``exact_suffix``, ``exact_budget``, ``select``, ...).
This module imports no torch, so the serving launcher and the CLI can validate a spec before any model
loads.  The math lives in :mod:`kvhub.serving.recompute`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from kvhub.errors import ConfigError

SELECTORS = ("source", "target", "deviation", "random")
SCORES = ("max", "sum")  # how the attention selectors reduce the queries (kvhub.serving.recompute)
SPANS = ("sentence", "token")

# kvhub.handoff's defaults: the first 4 (attention sinks), the last 16 and 8% of the context chosen by the
# source's attention, under 10% of a context of 1k tokens or more (docs/benchmarks.md, section 4).
DEFAULT_EXACT_PREFIX = 4
DEFAULT_EXACT_SUFFIX = 16
DEFAULT_EXACT_BUDGET = 0.08
DEFAULT_SELECT = "source"
# Inside vLLM the consumer selects by the small model's attention, which the producer stores with the KV
# (select=source; the large model's own over the mapped cache, select=target, where an entry has none).
# Measured through kvhub serve on the same items (docs/serving.md, "Which selector"): facts 1.00 with either
# (random 0.00), and source skips the large model's selection pass (TTFT 5.7x vs 4.4x at 1k, 6.2x vs 5.6x
# at 2k).  What the consumer can select by (kvhub.serving.engine_pass.recompute_request):
SERVING_SELECT = "source"
SERVING_SELECTORS = ("target", "source", "random")


@dataclass(frozen=True)
class Recompute:
    """Which context tokens the target recomputes at handoff (:mod:`kvhub.serving.recompute`).

    exact_prefix / exact_suffix: the first p and the last r context tokens; exact_budget: the fraction of
    the context chosen by ``select`` beyond them; spans: "sentence" (whole sentences / lines) or
    "token"; queries: how many last context tokens score the context (source / target selectors);
    score: how their attention is reduced to one score per token ("max" or "sum").
    """

    exact_prefix: int = 0
    exact_suffix: int = 0
    exact_budget: float = 0.0
    select: str = "source"
    spans: str = "sentence"
    queries: int = 16
    max_span: int = 48
    score: str = "max"

    def __post_init__(self):
        if self.exact_prefix < 0 or self.exact_suffix < 0:
            raise ConfigError("exact_prefix and exact_suffix count tokens: use numbers >= 0")
        if not 0.0 <= self.exact_budget <= 1.0:
            raise ConfigError(f"exact_budget is a fraction of the context in [0, 1], got {self.exact_budget}")
        if self.select not in SELECTORS:
            raise ConfigError(f"unknown token selector {self.select!r}; use one of {', '.join(SELECTORS)}")
        if self.score not in SCORES:
            raise ConfigError(f"unknown attention score {self.score!r}; use one of {', '.join(SCORES)}")
        if self.spans not in SPANS:
            raise ConfigError(f"spans must be one of {', '.join(SPANS)}, got {self.spans!r}")
        if self.queries < 1 or self.max_span < 1:
            raise ConfigError("queries and max_span must be >= 1")

    @property
    def selective(self) -> bool:
        return self.exact_budget > 0

    def name(self) -> str:
        """'' for the plain map, else e.g. 'exact_prefix=4,exact_suffix=16,exact_budget=0.1,select=source'."""
        parts = [f"exact_prefix={self.exact_prefix}"] * bool(self.exact_prefix)
        parts += [f"exact_suffix={self.exact_suffix}"] * bool(self.exact_suffix)
        if self.selective:
            parts.append(f"exact_budget={self.exact_budget:g}")
            defaults = Recompute()
            for field in ("select", "spans", "queries", "max_span", "score"):
                if field == "select" or getattr(self, field) != getattr(defaults, field):
                    parts.append(f"{field}={getattr(self, field)}")
        return ",".join(parts)

    @classmethod
    def parse(cls, text: str, *, base: "Recompute | None" = None) -> "Recompute":
        """Inverse of :meth:`name`: 'exact_prefix=4,exact_budget=0.1,select=deviation' -> Recompute (fields
        not named are ``base``'s, by default ``Recompute()``'s)."""
        values = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, _, value = part.partition("=")
            if key.strip() not in FIELDS or not value:
                raise ConfigError(
                    f"cannot read {part!r} in the recompute spec {text!r}; use e.g. "
                    "'exact_prefix=4,exact_suffix=16,exact_budget=0.1,select=source'"
                )
            values[key.strip()] = value.strip()
        return cls.from_options(values, base=base, origin=repr(text))

    @classmethod
    def from_options(
        cls, options: dict, *, base: "Recompute | None" = None, origin: str = "the options"
    ) -> "Recompute":
        """``base`` (default: ``Recompute()``) with the spec fields found in ``options`` (numbers may be given as
        text, as in a config file); other keys are ignored.  ConfigError names the bad value."""
        values: dict[str, Any] = {}
        for key, kind in FIELDS.items():
            if options.get(key) is None:
                continue
            values[key] = _field_value(key, kind, options[key], origin=origin)
        return replace(base or cls(), **values)

    def options(self) -> dict:
        """The spec as {field: value}, the keys of :data:`FIELDS` (kv_connector_extra_config, mapper.json)."""
        return {key: getattr(self, key) for key in FIELDS}

    def capped(self, context: int) -> "Recompute":
        """This spec with the prefix and suffix capped to a context of ``context`` tokens."""
        prefix = min(self.exact_prefix, context)
        return replace(self, exact_prefix=prefix, exact_suffix=min(self.exact_suffix, context - prefix))


def _field_value(key: str, kind: str, value, *, origin: str):
    """``value`` as the field's type, strictly: a count is a whole number (2.7 is not 2, true is not 1), a
    fraction a finite number; either may be given as text.  ConfigError names the key otherwise."""
    if kind == "str":
        return str(value)
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{key} in {origin} must be a number, got {value!r}")
    try:
        number = int(value) if kind == "int" and not isinstance(value, float) else float(value)
    except ValueError:
        raise ConfigError(
            f"{key} in {origin} must be {'a whole number' if kind == 'int' else 'a number'}, got {value!r}"
        ) from None
    if kind == "int":
        if isinstance(number, float):
            raise ConfigError(f"{key} in {origin} must be a whole number, got {value!r}")
        return number
    if number != number or number in (float("inf"), float("-inf")):
        raise ConfigError(f"{key} in {origin} must be a finite number, got {value!r}")
    return number


FIELDS: dict[str, str] = {f.name: str(f.type) for f in fields(Recompute)}  # name -> "int" / "float" / "str"
HANDOFF = Recompute(DEFAULT_EXACT_PREFIX, DEFAULT_EXACT_SUFFIX, DEFAULT_EXACT_BUDGET, DEFAULT_SELECT)
SERVING = replace(HANDOFF, select=SERVING_SELECT)
