"""Two versions side by side (``kvhub diff``): plain, JSON-ready rows, formatted by the CLI."""

from __future__ import annotations

from kvhub.artifact.metadata import shown
from kvhub.store.records import corpus_hash


def compare_versions(a: dict, b: dict, *, per_layer: bool) -> list[dict]:
    """Rows {field, a, b, delta, changed} comparing two :meth:`Store.describe` dicts, one per field either
    has: calibration, fit options, metrics (as given: pass the newest of each) and, with ``per_layer``,
    each target layer's sources and per-layer metrics.  ``delta`` is b - a where both are numbers."""
    left, right = _fields(a, per_layer), _fields(b, per_layer)
    names = list(left) + [name for name in right if name not in left]
    return [{"field": name, "a": left.get(name), "b": right.get(name), "delta": _delta(left.get(name), right.get(name)),
             "changed": left.get(name) != right.get(name)} for name in names]


def _delta(x, y):
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (x, y))
    return y - x if numbers else None


def _fields(data: dict, per_layer: bool) -> dict:
    """{field: value} of one version as `kvhub diff` compares it (plain values, never formatted)."""
    calibration = data["calibration_set"]
    fields = {
        "ref": data["ref"], "created": data["created_at"][:16], "aliases": ", ".join(data["aliases"]) or "-",
        "source": data["source_model"]["name"], "target": data["target_model"]["name"],
        "calibration": calibration["name"], "calibration text": corpus_hash(calibration.get("recipe")),
        "calibration content": calibration["content_hash"], "calibration tokens": calibration["tokens"],
        "k": shown(data["k"]), "lambda": shown(data["ridge_lambda"]),
        "tensors sha256": data["tensors_sha256"], "written by": f"kvhub {data['kvhub_version']}",
    }
    for m in data["metrics"]:
        if m["layer"] is None or per_layer:
            fields[_metric_label(m)] = m["value"]
    if per_layer:
        for layer in data["selected_layers"]:
            fields[f"layer {layer.get('target')} sources"] = ",".join(map(str, layer.get("sources", [])))
    return fields


def _metric_label(metric: dict) -> str:
    """``NAME[@TASK][ (split)][ layer N]``: the --min-metric spelling, then split and layer."""
    label = metric["name"] + (f"@{metric['task']}" if metric["task"] else "")
    label += f" ({metric['split']})" if metric["split"] else ""
    return label + (f" layer {metric['layer']}" if metric["layer"] is not None else "")
