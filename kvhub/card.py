"""Hugging Face model cards (README.md) for mapper artifacts.

A card is YAML front matter in Hub conventions plus a Markdown body, both derived from mapper.json
only (no clock, no environment), so the same version always renders the same bytes and a re-push of
an unchanged version uploads nothing.

Front matter: ``library_name: kvhub``, ``base_model: [SRC, DST]`` with ``base_model_relation: adapter``,
``tags`` (kvhub, kv-cache, the family), ``datasets`` when the calibration set names a Hub dataset,
``license`` when mapper.json states one, a ``model-index`` with the held-out R^2 (and evaluation
results), and a ``kvhub`` block (version, fingerprints' hashes, calibration, sha256 of the tensors)
that ``kvhub search`` reads back from the Hub's card data.

The last line is ``<!-- kvhub-card sha256:HEX -->``, HEX being the sha256 of everything above it:
:func:`card_is_pristine` tells a card kvhub wrote and nobody touched from one edited by hand.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

from .artifact import FIGURE_SUFFIXES as IMAGE_SUFFIXES  # noqa: F401  (the artifact format names the figures)

MARKER_PREFIX = "<!-- kvhub-card sha256:"
_MARKER = re.compile(r"\n<!-- kvhub-card sha256:([0-9a-f]{64}) -->\n?\Z")
RELATION = "adapter"


def model_card(metadata: dict, *, repo_id: str, version_tag: str, images: Iterable[str] = (),
               base_model: tuple[str, str] | None = None) -> str:
    """README.md text for the artifact described by ``metadata`` (mapper.json), pushed as ``version_tag``.

    ``images``: file names (relative to the artifact directory) shown in a "Figures" section.
    ``base_model``: Hub ids of (source, target) overriding the fingerprints' model ids.
    """
    text = _front_matter(metadata, repo_id=repo_id, version_tag=version_tag, base_model=base_model) + _body(
        metadata, repo_id=repo_id, version_tag=version_tag, images=sorted(images)
    )
    digest = hashlib.sha256(text.encode()).hexdigest()
    return f"{text}\n{MARKER_PREFIX}{digest} -->\n"


def card_is_pristine(text: str) -> bool:
    """True if ``text`` is a card kvhub generated and nobody edited since (its marker hash still matches)."""
    match = _MARKER.search(text)
    if match is None:
        return False
    body = text[: match.start()]
    return hashlib.sha256(body.encode()).hexdigest() == match.group(1)


def read_front_matter(text: str) -> dict:
    """The YAML front matter of a README.md as a dict ({} when there is none or it does not parse)."""
    import yaml

    if not text.startswith("---"):
        return {}
    head, sep, _ = text[3:].partition("\n---")
    if not sep:
        return {}
    try:
        data = yaml.safe_load(head)
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


# ---- front matter ----------------------------------------------------------------------------------
def _numbers(obj, prefix: str = "") -> list[tuple[str, float]]:
    """Flatten nested dicts of numbers into (dotted name, value) pairs; non-numbers are skipped."""
    if isinstance(obj, bool):
        return []
    if isinstance(obj, (int, float)):
        return [(prefix, obj)]
    if isinstance(obj, dict):
        out = []
        for key in sorted(obj):
            out += _numbers(obj[key], f"{prefix}.{key}" if prefix else str(key))
        return out
    return []


def _front_matter(metadata: dict, *, repo_id: str, version_tag: str, base_model: tuple[str, str] | None) -> str:
    from huggingface_hub import EvalResult, ModelCardData

    source, target = metadata["source"], metadata["target"]
    calibration = metadata.get("calibration") or {}
    calib_name = calibration.get("name") or "unknown"
    family = source.get("family") or source.get("model_type")
    dataset = calibration.get("hub_dataset")
    results = [
        EvalResult(
            task_type="kv-cache-mapping", task_name="KV-cache mapping",
            dataset_type=dataset or f"kvhub-calibration/{calib_name}", dataset_name=f"{calib_name} (held-out)",
            metric_type=name, metric_name=name, metric_value=value,
        )
        for name, value in _numbers(metadata.get("metrics") or {})
        if name.startswith("heldout_r2")
    ]
    results += [
        EvalResult(
            task_type="kv-cache-mapping", task_name=name.split(".")[0],
            dataset_type=name.split(".")[0], dataset_name=name.split(".")[0],
            metric_type=name.split(".", 1)[-1], metric_value=value,
        )
        for name, value in _numbers(metadata.get("evaluation") or {})
    ]
    data = ModelCardData(
        library_name="kvhub",
        base_model=list(base_model) if base_model else [source["model_id"], target["model_id"]],
        base_model_relation=RELATION,
        tags=[t for t in ("kvhub", "kv-cache", family) if t],
        datasets=[dataset] if dataset else None,
        license=metadata.get("license"),
        model_name=repo_id.split("/")[-1],
        eval_results=results or None,
        kvhub={
            "version": version_tag,
            "format_version": metadata.get("format_version"),
            "kvhub_version": metadata.get("kvhub_version"),
            "source": _fingerprint_summary(source),
            "target": _fingerprint_summary(target),
            "calibration": {k: calibration.get(k) for k in ("name", "version", "content_hash") if k in calibration},
            "k": metadata.get("k"),
            "lambda": metadata.get("lambda"),
            "structure": metadata.get("structure") or {"head_groups": 1, "rank": None},
            "weighting": (metadata.get("fit") or {}).get("weighting", "uniform"),
            "tensors_sha256": (metadata.get("tensors") or {}).get("sha256"),
            "metrics": dict(_numbers(metadata.get("metrics") or {})),
        },
    )
    return f"---\n{data.to_yaml()}\n---\n"


def _fingerprint_summary(fingerprint: dict) -> dict:
    keys = ("model_id", "revision", "config_hash", "tokenizer_hash", "num_layers", "num_kv_heads", "head_dim")
    return {key: fingerprint.get(key) for key in keys}


# ---- body --------------------------------------------------------------------------------------------
def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def _body(metadata: dict, *, repo_id: str, version_tag: str, images: list[str]) -> str:
    source, target = metadata["source"], metadata["target"]
    calibration = metadata.get("calibration") or {}
    sections = [
        f"\n# {source['model_id']} → {target['model_id']} KV-cache mapper ({version_tag})\n",
        "A kvhub mapper: per-layer affine maps (ridge regression on "
        "calibration statistics, rotary embedding stripped from the keys) that turn the KV cache of the "
        "**source** model into the cache the **target** model would have computed for the same tokens, so "
        "the target continues from the source's prefill without re-reading the context.  It is an "
        "approximation: see the held-out R² below before relying on it.\n",
        _validity_section(source, target),
        _calibration_section(calibration),
        _fit_section(metadata),
        _results_section(metadata),
        _usage_section(source, target, repo_id, version_tag),
    ]
    if images:
        sections.append("## Figures\n\n" + "\n".join(f"![{name}]({name})" for name in images) + "\n")
    tensors = metadata.get("tensors") or {}
    sections.append(
        "## Files\n\n"
        f"- `mapper.safetensors`: fp32 weights, sha256 `{tensors.get('sha256')}` ({_fmt(tensors.get('bytes'))} bytes)\n"
        "- `mapper.json`: everything on this card, machine-readable (kvhub checks the sha256 on load)\n\n"
        f"Written by kvhub {metadata.get('kvhub_version')}, artifact format version "
        f"{metadata.get('format_version')}.\n"
    )
    return "\n".join(sections)


def _short(digest: str | None) -> str:
    return f"`{digest[:12]}`" if digest else "-"


def _validity_section(source: dict, target: dict) -> str:
    rows = "\n".join(
        f"| {role} | `{fp['model_id']}` | {_fmt(fp.get('revision'))} | {_short(fp.get('config_hash'))} | "
        f"{_short(fp.get('tokenizer_hash'))} | {fp.get('num_layers')} | "
        f"{fp.get('num_kv_heads')} x {fp.get('head_dim')} |"
        for role, fp in (("source", source), ("target", target))
    )
    return (
        "## Valid for\n\n"
        "| role | model | revision | config sha256 | tokenizer sha256 | layers | KV heads x head dim |\n"
        "| --- | --- | --- | --- | --- | --- | --- |\n"
        f"{rows}\n\n"
        "kvhub refuses caches whose geometry differs; other revisions of these models may not match the "
        "fingerprints (config and tokenizer hashes) above.\n"
    )


def _calibration_section(calibration: dict) -> str:
    lines = [f"- name: `{calibration.get('name')}`, version {_fmt(calibration.get('version'))}"]
    lines.append(f"- content sha256: `{calibration.get('content_hash')}`")
    if calibration.get("tokens") is not None:
        lines.append(f"- tokens: {calibration['tokens']:,}")
    if calibration.get("license"):
        lines.append(f"- licence of the calibration text: {calibration['license']}")
    return "## Calibration set\n\n" + "\n".join(lines) + "\n"


def _fit_section(metadata: dict) -> str:
    rows = "\n".join(
        f"| {layer['target']} | {', '.join(str(s) for s in layer['sources'])} | {_fmt(layer.get('r2_k'))} | "
        f"{_fmt(layer.get('r2_v'))} |"
        for layer in metadata.get("layers", [])
    )
    return (
        "## Fit\n\n"
        f"k = {_fmt(metadata.get('k'))} source layers per target layer, "
        f"ridge lambda = {_fmt(metadata.get('lambda'))}; maps: {_structure(metadata)}; "
        f"token weighting: {(metadata.get('fit') or {}).get('weighting', 'uniform')}.\n\n"
        "| target layer | source layers | held-out R² (K) | held-out R² (V) |\n| --- | --- | --- | --- |\n"
        f"{rows}\n"
    )


def _structure(metadata: dict) -> str:
    return describe_structure(metadata.get("structure"))


def describe_structure(structure: dict | None) -> str:
    """'dense', 'head-local (2 groups)', 'rank 64', or both, from mapper.json's ``structure``."""
    structure = structure or {}
    groups, rank = structure.get("head_groups") or 1, structure.get("rank")
    parts = [f"head-local ({groups} groups)"] if groups > 1 else []
    if rank is not None:
        parts.append(f"rank {rank}")
    return ", ".join(parts) or "dense"


def _results_section(metadata: dict) -> str:
    rows = [(name, value) for name, value in _numbers(metadata.get("metrics") or {})]
    rows += [(f"eval: {name}", value) for name, value in _numbers(metadata.get("evaluation") or {})]
    table = "\n".join(f"| {name} | {_fmt(value)} |" for name, value in rows) or "| (none recorded) | |"
    return "## Results\n\n| metric | value |\n| --- | --- |\n" + table + "\n"


def _usage_section(source: dict, target: dict, repo_id: str, version_tag: str) -> str:
    return (
        "## Use\n\n"
        "```python\n"
        "import kvhub\n"
        f'mapper = kvhub.load("{source["model_id"]}", "{target["model_id"]}", hub_repo="{repo_id}@{version_tag}")\n'
        "target_cache = mapper.transfer(source_cache)  # the source's cache over the prompt minus its last token\n"
        "```\n\n"
        f"or `kvhub pull {repo_id}@{version_tag}` to verify and register it in the local store.\n"
    )
