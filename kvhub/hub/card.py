"""Hugging Face model cards (README.md) for mapper artifacts.

A card is YAML front matter in Hub conventions plus a Markdown body, both derived from mapper.json
only (no clock, no environment), so the same version always renders the same bytes and a re-push of
an unchanged version uploads nothing.

The models are named by their Hub ids everywhere (title, tables, metadata: :func:`base_models`,
kvhub.hub.identity); no local path is published.

Front matter: ``library_name: kvhub``, ``base_model: [SRC, DST]`` with ``base_model_relation: adapter``,
``tags`` (kvhub, kv-cache, the family), ``datasets`` for the ``hf:`` sources of the calibration set,
``license`` as the publisher chose it (:func:`card_license`; by default the calibration text's when that
is a Hub licence id), a ``model-index`` with every stored evaluation on a Hub dataset (each with its
dataset id and split: the Hub requires an id, so evaluations on local or synthetic data are in the body
only), and a ``kvhub`` block (version, fingerprints' hashes, calibration, sha256 of the tensors) that
``kvhub search`` reads back from the Hub's card data.  The body lists every stored evaluation (tasks,
perplexity, long context, with their controls and 95% intervals) and the transfer-vs-re-prefill
timings (``kvhub bench``); counts (train and held-out tokens) are in the fit section, not the results.

Besides mapper.json, a card reads the store's measurements of the version (``measurements``: the
metric dicts of Store.metrics); the newest of each kind wins, and no timestamp enters the text.

The last line is ``<!-- kvhub-card sha256:HEX -->``, HEX being the sha256 of everything above it:
:func:`card_is_pristine` tells a card kvhub wrote and nobody touched from one edited by hand.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass

from kvhub.artifact.kinds import kind_of
from kvhub.artifact.metadata import calibration_series, describe_structure, shown
from kvhub.errors import ConfigError
from kvhub.hub.evaluations import (
    _TASK_DATASETS,
    bench_section,
    calibration_dataset,
    evaluation_results,
    evaluations_table,
    fmt,
    hub_datasets,
    latest,
)
from kvhub.hub.identity import base_models, published_metadata

MARKER_PREFIX = "<!-- kvhub-card sha256:"
_MARKER = re.compile(r"\n<!-- kvhub-card sha256:([0-9a-f]{64}) -->\n?\Z")
RELATION = "adapter"


def model_card(
    metadata: dict,
    *,
    repo_id: str,
    version_tag: str,
    images: Iterable[str] = (),
    base_model: tuple[str, str] | None = None,
    measurements: Iterable[dict] = (),
    license: CardLicense | None = None,
) -> str:
    """README.md text for the artifact described by ``metadata`` (mapper.json), pushed as ``version_tag``.

    ``images``: file names (relative to the artifact directory) shown in a "Figures" section.
    ``base_model``: Hub ids of (source, target) when the fingerprints name local models (:func:`base_models`);
    the card names the models by these ids only (kvhub.hub.identity.published_metadata).
    ``measurements``: the store's metric dicts of this version (evaluations and timings).
    ``license``: the publisher's choice (:func:`card_license`); default :func:`default_license`.
    """
    newest = latest(measurements)
    bases = base_models(metadata, base_model)
    metadata = published_metadata(metadata, bases)
    text = _front_matter(
        metadata, repo_id=repo_id, version_tag=version_tag, base_model=bases, evaluations=newest, license=license
    ) + _body(metadata, repo_id=repo_id, version_tag=version_tag, images=sorted(images), measurements=newest)
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
    except (yaml.YAMLError, RecursionError, MemoryError):  # nested past the parser: not a card kvhub wrote
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


# ---- what the Hub indexes: base models, licence, datasets ----------------------------------------
# Hub licence identifiers a calibration licence may start with (a default when the publisher names none)
_HUB_LICENSES = {
    "apache-2.0",
    "mit",
    "cc0-1.0",
    "cc-by-4.0",
    "cc-by-sa-4.0",
    "cc-by-nc-4.0",
    "cc-by-sa-3.0",
    "bsd-2-clause",
    "bsd-3-clause",
    "gpl-2.0",
    "gpl-3.0",
    "lgpl-3.0",
    "mpl-2.0",
    "unlicense",
    "odc-by",
    "pddl",
    "openrail",
}
_LICENSE_ID = re.compile(r"[a-z0-9][a-z0-9.+-]{0,63}")


@dataclass(frozen=True)
class CardLicense:
    """The card's ``license`` (a Hub licence id), with ``license_name`` and ``license_link`` for "other"."""

    id: str
    name: str | None = None
    link: str | None = None


def card_license(license: str | None, *, name: str | None = None, link: str | None = None) -> CardLicense | None:
    """The publisher's licence choice, checked as the Hub spec wants it: a licence id ("apache-2.0"), and
    for "other" a licence name (a slug) and a link to its text (a URL or a file in the repository)."""
    if license is None:
        if name or link:
            raise ConfigError(
                'a licence name or link was given without a licence; pass the licence "other" '
                "with them, or a Hub licence id such as apache-2.0 alone"
            )
        return None
    license = license.strip().lower()
    if not _LICENSE_ID.fullmatch(license):
        raise ConfigError(
            f"licence {license!r} is not a Hub licence id; write one such as apache-2.0, mit, "
            "llama3.1 or other (https://huggingface.co/docs/hub/repositories-licenses)"
        )
    if license != "other":
        if name or link:
            raise ConfigError(f'a licence name and link go with the licence "other" only, not {license!r}')
        return CardLicense(license)
    if not (name and _LICENSE_ID.fullmatch(name) and link and link.strip()):
        raise ConfigError(
            'the licence "other" needs a licence name (a slug such as my-licence) and a link to '
            "its text (a URL, or a file in the repository such as LICENSE)"
        )
    return CardLicense("other", name, link.strip())


def default_license(metadata: dict) -> CardLicense | None:
    """mapper.json's ``license``, else the calibration text's licence, when it is a Hub licence id (the
    mapper is derived from that text); None otherwise: the publisher names one."""
    calibration = metadata.get("calibration") or {}
    text = str(metadata.get("license") or calibration.get("licence") or calibration.get("license") or "").strip()
    first = text.split()[0].strip(",;()").lower() if text else ""
    return CardLicense(first) if first in _HUB_LICENSES else None


def _front_matter(
    metadata: dict,
    *,
    repo_id: str,
    version_tag: str,
    base_model: tuple[str, str],
    evaluations: dict,
    license: CardLicense | None,
) -> str:
    from huggingface_hub import EvalResult, ModelCardData

    source, target = metadata["source"], metadata["target"]
    calibration = metadata.get("calibration") or {}
    calib_name = calibration_series(calibration) or "unknown"
    family = source.get("family") or source.get("model_type")
    datasets = hub_datasets(calibration)
    held_out = calibration_dataset(calibration)
    results = [  # held-out R^2: an index entry only when the calibration text is one Hub dataset
        EvalResult(
            task_type="kv-cache-mapping",
            task_name="KV-cache mapping",
            dataset_type=held_out[0],
            dataset_name=f"{calib_name} (held-out documents)",
            dataset_config=held_out[1],
            dataset_split=held_out[2],
            metric_type=name,
            metric_name=name,
            metric_value=value,
        )
        for name, value in _numbers(metadata.get("metrics") or {})
        if name.startswith("heldout_r2") and held_out is not None
    ]
    results += [  # a legacy mapper.json ``evaluation`` block ({task: {metric: value}}), on Hub datasets only
        EvalResult(
            task_type="kv-cache-transfer",
            task_name=name.split(".")[0],
            dataset_type=dataset[0],
            dataset_name=name.split(".")[0],
            dataset_config=dataset[1],
            dataset_split=dataset[2],
            metric_type=name.split(".", 1)[-1],
            metric_value=value,
        )
        for name, value in _numbers(metadata.get("evaluation") or {})
        if (dataset := _TASK_DATASETS.get(name.split(".")[0])) is not None
    ]
    results += evaluation_results(evaluations, calibration)
    license = license or default_license(metadata)
    data = ModelCardData(
        library_name="kvhub",
        base_model=list(base_model),
        base_model_relation=RELATION,
        tags=[t for t in ("kvhub", "kv-cache", family) if t],
        datasets=datasets or None,
        license=license.id if license else None,
        license_name=license.name if license else None,
        license_link=license.link if license else None,
        model_name=repo_id.split("/")[-1],
        eval_results=results or None,
        kvhub={
            "version": version_tag,
            "format_version": metadata.get("format_version"),
            "kvhub_version": metadata.get("kvhub_version"),
            "source": _fingerprint_summary(source),
            "target": _fingerprint_summary(target),
            "calibration": {k: calibration.get(k) for k in ("name", "version", "content_hash") if k in calibration},
            "k": shown(metadata.get("k")),
            "lambda": shown(metadata.get("lambda")),
            "structure": metadata.get("structure") or {"head_groups": 1, "rank": None},
            "map": _map_summary(metadata),
            "weighting": (metadata.get("fit") or {}).get("weighting", "uniform"),
            "tensors_sha256": (metadata.get("tensors") or {}).get("sha256"),
            "metrics": dict(_numbers(metadata.get("metrics") or {})),
        },
    )
    return f"---\n{data.to_yaml()}\n---\n"


def _map_summary(metadata: dict) -> dict:
    """The card's ``map`` entry: the kind, and an mlp map's width, depth and activation."""
    kind = kind_of(metadata)
    settings = metadata.get(kind.block) or {} if kind.block else {}
    return {"kind": kind.name, **{key: settings[key] for key in ("width", "depth", "activation") if key in settings}}


def _fingerprint_summary(fingerprint: dict) -> dict:
    keys = ("model_id", "revision", "config_hash", "tokenizer_hash", "num_layers", "num_kv_heads", "head_dim")
    return {key: fingerprint.get(key) for key in keys}


# ---- body --------------------------------------------------------------------------------------------
_fmt = fmt


def _body(metadata: dict, *, repo_id: str, version_tag: str, images: list[str], measurements: dict) -> str:
    source, target = metadata["source"], metadata["target"]
    calibration = metadata.get("calibration") or {}
    sections = [
        f"\n# {source['model_id']} → {target['model_id']} KV-cache mapper ({version_tag})\n",
        f"A kvhub mapper: per-layer affine maps (ridge regression on "
        f"calibration statistics, rotary embedding stripped from the keys){_residual_clause(metadata)} that turn the KV cache of the "
        "**source** model into the cache the **target** model would have computed for the same tokens, so "
        "the target continues from the source's prefill without re-reading the context.  It is an "
        "approximation: see the held-out R² below before relying on it.\n",
        _validity_section(source, target),
        _calibration_section(calibration),
        _fit_section(metadata),
        _results_section(metadata, measurements),
        bench_section(measurements),
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
    return "\n".join(section for section in sections if section)


def _residual_clause(metadata: dict) -> str:
    """', each plus a residual MLP (2 x 256, gelu) trained on calibration rows' for an mlp map, else ''."""
    if kind_of(metadata).name != "mlp":
        return ""
    settings = metadata.get("mlp") or {}
    return (
        f", each plus a residual MLP ({settings.get('depth')} x {settings.get('width')}, "
        f"{settings.get('activation')}) trained on calibration rows"
    )


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
    licence = calibration.get("licence") or calibration.get("license")
    if licence:
        lines.append(f"- licence of the calibration text: {licence}")
    return "## Calibration set\n\n" + "\n".join(lines) + "\n"


def _fit_section(metadata: dict) -> str:
    rows = "\n".join(
        f"| {layer['target']} | {', '.join(str(s) for s in layer['sources'])} | {_fmt(layer.get('r2_k'))} | "
        f"{_fmt(layer.get('r2_v'))} |"
        for layer in metadata.get("layers", [])
    )
    return (
        "## Fit\n\n"
        f"k = {_fmt(shown(metadata.get('k')))} source layers per target layer, "
        f"ridge lambda = {_fmt(shown(metadata.get('lambda')))}; maps: {_structure(metadata)}, "
        f"{kind_of(metadata).describe(metadata.get(kind_of(metadata).block or '') or {})}; "
        f"token weighting: {(metadata.get('fit') or {}).get('weighting', 'uniform')}.{_counts(metadata)}\n\n"
        "| target layer | source layers | held-out R² (K) | held-out R² (V) |\n| --- | --- | --- | --- |\n"
        f"{rows}\n"
    )


def _structure(metadata: dict) -> str:
    return describe_structure(metadata.get("structure"))


def _counts(metadata: dict) -> str:
    """' Fitted on 288 train tokens, checked on 72 held-out tokens.': counts, which are no results."""
    metrics = metadata.get("metrics") or {}
    train, held = metrics.get("train_tokens"), metrics.get("heldout_tokens")
    if train is None and held is None:
        return ""
    return f" Fitted on {_fmt(train)} train tokens, checked on {_fmt(held)} held-out tokens."


def _results_section(metadata: dict, measurements: dict) -> str:
    rows = [(name, value) for name, value in _numbers(metadata.get("metrics") or {}) if not name.endswith("_tokens")]
    rows += [(f"eval: {name}", value) for name, value in _numbers(metadata.get("evaluation") or {})]
    table = "\n".join(f"| {name} | {_fmt(value)} |" for name, value in rows) or "| (none recorded) | |"
    return "## Results\n\n| metric | value |\n| --- | --- |\n" + table + "\n" + evaluations_table(measurements)


def _usage_section(source: dict, target: dict, repo_id: str, version_tag: str) -> str:
    return (
        "## Use\n\n"
        "```python\n"
        "import kvhub\n"
        f'mapper = kvhub.Mapper.from_pretrained("{repo_id}", revision="{version_tag}")\n'
        f'# or by the models: kvhub.load("{source["model_id"]}", "{target["model_id"]}", hub_repo="{repo_id}")\n'
        "target_cache = mapper.transfer(source_cache)  # the source's cache over the prompt minus its last token\n"
        "```\n\n"
        f"or `kvhub pull {repo_id}@{version_tag}` to verify and register it in the local store.\n"
    )
