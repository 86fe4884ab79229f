"""Hugging Face model cards (README.md) for mapper artifacts.

A card is YAML front matter in Hub conventions plus a Markdown body, both derived from mapper.json
only (no clock, no environment), so the same version always renders the same bytes and a re-push of
an unchanged version uploads nothing.

Front matter: ``library_name: kvhub``, ``base_model: [SRC, DST]`` as Hub ids (:func:`base_models`) with
``base_model_relation: adapter``, ``tags`` (kvhub, kv-cache, the family), ``datasets`` for the ``hf:``
sources of the calibration set, ``license`` from the calibration set's ``licence``, a ``model-index``
with the held-out R^2 and the stored task evaluations (retention, accuracy own / mapped / source, gap
closed; per variant, with n), and a ``kvhub`` block (version, fingerprints' hashes, calibration,
sha256 of the tensors) that ``kvhub search`` reads back from the Hub's card data.  The body adds the
stored transfer-vs-re-prefill timings (``kvhub bench``).

Besides mapper.json, a card reads the store's measurements of the version (``measurements``: the
metric dicts of Store.metrics); the newest of each kind wins, and no timestamp enters the text.

The last line is ``<!-- kvhub-card sha256:HEX -->``, HEX being the sha256 of everything above it:
:func:`card_is_pristine` tells a card kvhub wrote and nobody touched from one edited by hand.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

from kvhub.artifact import FIGURE_SUFFIXES as IMAGE_SUFFIXES  # noqa: F401  (the artifact format names the figures)

from kvhub.errors import ConfigError
from kvhub.hub.client import is_repo_id

MARKER_PREFIX = "<!-- kvhub-card sha256:"
_MARKER = re.compile(r"\n<!-- kvhub-card sha256:([0-9a-f]{64}) -->\n?\Z")
RELATION = "adapter"


def model_card(metadata: dict, *, repo_id: str, version_tag: str, images: Iterable[str] = (),
               base_model: tuple[str, str] | None = None, measurements: Iterable[dict] = ()) -> str:
    """README.md text for the artifact described by ``metadata`` (mapper.json), pushed as ``version_tag``.

    ``images``: file names (relative to the artifact directory) shown in a "Figures" section.
    ``base_model``: Hub ids of (source, target) when the fingerprints name local models (:func:`base_models`).
    ``measurements``: the store's metric dicts of this version (evaluations and timings).
    """
    latest = _latest(measurements)
    bases = base_models(metadata, base_model)
    text = _front_matter(metadata, repo_id=repo_id, version_tag=version_tag, base_model=bases,
                         evaluations=latest) + _body(
        metadata, repo_id=repo_id, version_tag=version_tag, images=sorted(images), measurements=latest
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


# ---- what the Hub indexes: base models, licence, datasets ----------------------------------------
# Hub licence identifiers a calibration licence may start with (others are published as "other")
_HUB_LICENSES = {"apache-2.0", "mit", "cc0-1.0", "cc-by-4.0", "cc-by-sa-4.0", "cc-by-nc-4.0", "cc-by-sa-3.0",
                 "bsd-2-clause", "bsd-3-clause", "gpl-2.0", "gpl-3.0", "lgpl-3.0", "mpl-2.0", "unlicense",
                 "odc-by", "pddl", "openrail"}


def is_hub_id(name: str) -> bool:
    """``owner/name`` as the Hub spells repository ids (a local path, or a local ``x/model.gguf``, never is one)."""
    return is_repo_id(name) and not name.endswith(".gguf")


def _known_hub_id(model_id: str) -> str | None:
    """The Hub id of a known model (registry/models.toml) a local path names by its directory or GGUF file."""
    from kvhub.models.resolve import known_models
    from kvhub.store.refs import short_name

    last = short_name(model_id)
    for model in known_models().values():
        if last.lower() in (model.name.lower(), model.gguf_file.lower(), short_name(model.hf_id).lower()):
            return model.hf_id
    return None


def base_models(metadata: dict, override: tuple[str, str] | None = None) -> tuple[str, str]:
    """Hub ids of (source, target) for ``base_model``: ``override`` (``--base-model SRC,DST``), else each
    fingerprint's model id when it is a Hub id, else the id of the known model a local path names.
    ConfigError, naming --base-model, when a model is a local path kvhub cannot map: a path must never
    be published as a base model."""
    if override is not None:
        bad = [name for name in override if not is_hub_id(name)]
        if bad:
            raise ConfigError(f"--base-model {bad[0]!r} is not a Hub model id; write OWNER/NAME, e.g. "
                              "Qwen/Qwen2.5-Coder-0.5B-Instruct")
        return override[0], override[1]
    ids = []
    for role in ("source", "target"):
        model_id = metadata[role]["model_id"]
        hub_id = model_id if is_hub_id(model_id) else _known_hub_id(model_id)
        if hub_id is None:
            raise ConfigError(f"the {role} model is the local path {model_id}, which must not be published as the "
                              "card's base_model and is no known model; name the Hub ids it was downloaded from: "
                              "--base-model SRC_ID,DST_ID (Python: base_model=(src_id, dst_id))")
        ids.append(hub_id)
    return ids[0], ids[1]


def _licence(calibration: dict) -> tuple[str | None, str | None]:
    """(Hub ``license``, ``license_name`` when it is "other") from the calibration set's ``licence``."""
    text = str(calibration.get("licence") or calibration.get("license") or "").strip()
    if not text:
        return None, None
    first = text.split()[0].strip(",;()").lower()
    if first in _HUB_LICENSES:
        return first, None
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:64]
    return "other", slug or None


def hub_datasets(calibration: dict) -> list[str]:
    """Hub dataset ids of the calibration set: its ``hf:DATASET:...`` sources (and a legacy ``hub_dataset``)."""
    found = [calibration["hub_dataset"]] if isinstance(calibration.get("hub_dataset"), str) else []
    for source in calibration.get("sources") or []:
        if isinstance(source, str) and source.startswith("hf:"):
            found.append(source[3:].split(":")[0])
    return sorted({name for name in found if name})


# ---- the store's measurements ------------------------------------------------------------------------
_EVAL_METRICS = {"retention": "retention", "acc_own": "accuracy, target's own cache",
                 "acc_mapped": "accuracy, mapped cache", "acc_source": "accuracy, source model",
                 "gap_closed": "gap closed"}
_BENCH_METRICS = ("transfer_median_s", "prefill_median_s", "speedup", "ttft_speedup")


def _latest(measurements: Iterable[dict]) -> dict[tuple[str, str, str], dict]:
    """{(split, task, name): metric} of whole-mapper measurements, the newest of each (input oldest first)."""
    latest = {}
    for metric in measurements:
        if metric.get("layer") is None and metric.get("split") in ("eval", "bench") and metric.get("task"):
            latest[(metric["split"], metric["task"], metric["name"])] = metric
    return latest


def _split_task(task: str) -> tuple[str, str]:
    """'hellaswag@exact_prefix=4,exact_suffix=16' -> ('hellaswag', 'exact_prefix=4,exact_suffix=16')."""
    base, _, variant = task.partition("@")
    return base, variant or "mapped"


def _evaluation_results(evaluations: dict) -> list:
    from huggingface_hub import EvalResult

    results = []
    for (split, task, name), metric in sorted(evaluations.items()):
        if split != "eval" or name not in _EVAL_METRICS:
            continue
        base, variant = _split_task(task)
        results.append(EvalResult(
            task_type="kv-cache-transfer", task_name=f"KV-cache transfer: {base}", dataset_type=base,
            dataset_name=base, metric_type=name, metric_name=f"{_EVAL_METRICS[name]} ({variant})",
            metric_value=metric["value"], metric_config=variant,
            metric_args={"variant": variant, "n": metric.get("n")},
        ))
    return results


def _front_matter(metadata: dict, *, repo_id: str, version_tag: str, base_model: tuple[str, str],
                  evaluations: dict) -> str:
    from huggingface_hub import EvalResult, ModelCardData

    source, target = metadata["source"], metadata["target"]
    calibration = metadata.get("calibration") or {}
    calib_name = calibration.get("name") or "unknown"
    family = source.get("family") or source.get("model_type")
    datasets = hub_datasets(calibration)
    dataset = datasets[0] if datasets else None
    license_id, license_name = _licence(calibration)
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
    results += _evaluation_results(evaluations)
    data = ModelCardData(
        library_name="kvhub",
        base_model=list(base_model),
        base_model_relation=RELATION,
        tags=[t for t in ("kvhub", "kv-cache", family) if t],
        datasets=datasets or None,
        license=metadata.get("license") or license_id,
        license_name=license_name if not metadata.get("license") else None,
        model_name=repo_id.split("/")[-1],
        eval_results=results or None,
        kvhub={
            "version": version_tag,
            "format_version": metadata.get("format_version"),
            "kvhub_version": metadata.get("kvhub_version"),
            "source": _fingerprint_summary(source),
            "target": _fingerprint_summary(target),
            "calibration": {k: calibration.get(k) for k in ("name", "version", "content_hash") if k in calibration},
            "k": _auto(metadata.get("k")),
            "lambda": _auto(metadata.get("lambda")),
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


def _auto(value):
    """A fit option as cards and JSON show it: "auto" when it was chosen per target layer (None)."""
    return "auto" if value is None else value


# ---- body --------------------------------------------------------------------------------------------
def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def _body(metadata: dict, *, repo_id: str, version_tag: str, images: list[str], measurements: dict) -> str:
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
        _results_section(metadata, measurements),
        _bench_section(measurements),
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
        f"k = {_fmt(_auto(metadata.get('k')))} source layers per target layer, "
        f"ridge lambda = {_fmt(_auto(metadata.get('lambda')))}; maps: {_structure(metadata)}; "
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


def _results_section(metadata: dict, measurements: dict) -> str:
    rows = [(name, value) for name, value in _numbers(metadata.get("metrics") or {})]
    rows += [(f"eval: {name}", value) for name, value in _numbers(metadata.get("evaluation") or {})]
    table = "\n".join(f"| {name} | {_fmt(value)} |" for name, value in rows) or "| (none recorded) | |"
    text = "## Results\n\n| metric | value |\n| --- | --- |\n" + table + "\n"
    evals = [(task, name, m) for (split, task, name), m in sorted(measurements.items())
             if split == "eval" and name in _EVAL_METRICS]
    if evals:
        lines = [f"| {_split_task(task)[0]} | {_split_task(task)[1]} | {_EVAL_METRICS[name]} | {_fmt(m['value'])} | "
                 f"{_fmt(m.get('n'))} |" for task, name, m in evals]
        text += ("\nTask evaluations (`kvhub eval`; variant = what the target recomputes exactly):\n\n"
                 "| task | variant | metric | value | n |\n| --- | --- | --- | --- | --- |\n" + "\n".join(lines) + "\n")
    return text


def _bench_section(measurements: dict) -> str:
    """Transfer vs re-prefill timings (``kvhub bench``; task ``bench:DEVICE:DTYPE:TOKENS[@variant]``)."""
    runs: dict[str, dict[str, float]] = {}
    for (split, task, name), metric in sorted(measurements.items()):
        if split == "bench" and name in _BENCH_METRICS:
            runs.setdefault(task, {})[name] = metric["value"]
    if not runs:
        return ""
    lines = []
    for task, values in runs.items():
        where, _, variant = task.partition("@")
        _, device, dtype, tokens = (where.split(":") + ["", "", "", ""])[:4]
        lines.append(f"| {device} | {dtype} | {tokens} | {variant or '-'} | "
                     + " | ".join(_fmt(values.get(name)) for name in _BENCH_METRICS) + " |")
    return ("## Speed\n\nMapping the source's cache vs the target re-reading the context (`kvhub bench`, medians):\n\n"
            "| device | dtype | context tokens | variant | transfer s | re-prefill s | speedup | TTFT speedup |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- |\n" + "\n".join(lines) + "\n")


def _usage_section(source: dict, target: dict, repo_id: str, version_tag: str) -> str:
    return (
        "## Use\n\n"
        "```python\n"
        "import kvhub\n"
        f'mapper = kvhub.Mapper.from_pretrained("{repo_id}@{version_tag}")\n'
        "target_cache = mapper.transfer(source_cache)  # the source's cache over the prompt minus its last token\n"
        "```\n\n"
        f"or `kvhub pull {repo_id}@{version_tag}` to verify and register it in the local store.\n"
    )
