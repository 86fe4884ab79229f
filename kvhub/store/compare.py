"""Two versions side by side (``kvhub diff``): plain, JSON-ready rows, formatted by the CLI."""

from __future__ import annotations

import json

from kvhub.artifact.metadata import shown
from kvhub.store.records import corpus_hash


def compare_versions(a: dict, b: dict, *, per_layer: bool) -> list[dict]:
    """Rows {field, a, b, delta, changed} comparing two :meth:`Store.describe` dicts, one per field either
    has: calibration, fit options, metrics (as given: pass the newest of each) and, with ``per_layer``,
    each target layer's sources and per-layer metrics.  ``delta`` is b - a where both are numbers."""
    left, right = _fields(a, per_layer), _fields(b, per_layer)
    names = list(left) + [name for name in right if name not in left]
    return [
        {
            "field": name,
            "a": left.get(name),
            "b": right.get(name),
            "delta": _delta(left.get(name), right.get(name)),
            "changed": left.get(name) != right.get(name),
        }
        for name in names
    ]


def _delta(x, y):
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (x, y))
    return y - x if numbers else None


def _fields(data: dict, per_layer: bool) -> dict:
    """{field: value} of one version as `kvhub diff` compares it (plain values, never formatted)."""
    calibration = data["calibration_set"]
    fields = {
        "ref": data["ref"],
        "created": data["created_at"][:16],
        "aliases": ", ".join(data["aliases"]) or "-",
        "source": data["source_model"]["name"],
        "target": data["target_model"]["name"],
        "calibration": calibration["name"],
        "calibration text": corpus_hash(calibration.get("recipe")),
        "calibration content": calibration["content_hash"],
        "calibration tokens": calibration["tokens"],
        **_calibration_size(calibration.get("recipe") or {}),
        "k": shown(data["k"]),
        "lambda": shown(data["ridge_lambda"]),
        **_fit_block(data),
        "tensors sha256": data["tensors_sha256"],
        "written by": f"kvhub {data['kvhub_version']}",
    }
    for m in data["metrics"]:
        if m["layer"] is None or per_layer:
            fields[_metric_label(m)] = m["value"]
    if per_layer:
        for layer in data["selected_layers"]:
            fields[f"layer {layer.get('target')} sources"] = ",".join(map(str, layer.get("sources", [])))
    return fields


def _calibration_size(calibration: dict) -> dict:
    """How much calibration text the fit read, and how (mapper.json's calibration block)."""
    keys = ("sequences", "heldout_sequences", "seq_len", "stride", "seed")
    return {f"calibration {key.replace('_', ' ')}": calibration.get(key) for key in keys if key in calibration}


def _fit_block(data: dict) -> dict:
    """The artifact's fit options (mapper.json's ``fit`` block: weighting, batch size, statistics, dtype,
    device ...) as ``fit NAME`` fields, a dict's keys as ``fit NAME.KEY``; nothing when the artifact cannot
    be read."""
    from pathlib import Path

    from kvhub.artifact import read_metadata
    from kvhub.errors import KVHubError

    try:
        block = read_metadata(Path(data["artifact_path"])).get("fit") or {}
    except (KVHubError, OSError, KeyError):
        return {}
    fields = {}
    for key, value in sorted(block.items()):
        name = f"fit {key.replace('_', ' ')}"
        if isinstance(value, dict):  # statistics, timings: one row per key, ``fit statistics.dtype``
            fields.update({f"{name}.{inner}": _plain(v) for inner, v in sorted(value.items())})
        else:
            fields[name] = _plain(value)
    return fields


def _plain(value):
    """A value a row can hold: nested dicts and lists as JSON text, everything else as it is."""
    return json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else value


def _metric_label(metric: dict) -> str:
    """``NAME[@TASK][ (split)][ layer N]``: the --min-metric spelling, then split and layer."""
    label = metric["name"] + (f"@{metric['task']}" if metric["task"] else "")
    label += f" ({metric['split']})" if metric["split"] else ""
    return label + (f" layer {metric['layer']}" if metric["layer"] is not None else "")
