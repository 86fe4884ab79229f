"""Model configs read without weights or network: :func:`load_config` finds one for a model spec (a config.json
or model directory, a fetched known model, a config kvhub ships in ``registry/configs``, or the Hugging Face
cache, offline), and :func:`kv_geometry` reduces it to what a mapper's fingerprint records of a model's KV
cache.  The plan (:mod:`kvhub.fitting.shapes`), the push's check of ``--base-model``
(:mod:`kvhub.hub.identity`) and ``kvhub serve``'s of the served models (:mod:`kvhub.serving.engine_limits`)
read configs through here.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvhub.errors import ConfigError


def shipped_configs() -> dict[str, dict]:
    """The configs kvhub ships (``registry/configs/*.json``), by lower-cased Hub id and file stem."""
    from importlib import resources

    out = {}
    for entry in resources.files("kvhub._registry").joinpath("configs").iterdir():
        if entry.name.endswith(".json"):
            config = json.loads(entry.read_text())
            out[entry.name[: -len(".json")].lower()] = config
            out[config.get("_name_or_path", "").lower()] = config
    return out


def load_config(spec: str) -> tuple[dict, str]:
    """(config dict, model id) of a spec, reading no weights.

    Tries, in order: a config.json file or a model directory; a fetched known model (kvhub.models.loading);
    a config kvhub ships; the Hugging Face cache (offline).
    """
    from kvhub.models.loading import find_known, resolve_model_path

    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file() and path.suffix == ".json":
        return _read_config(path), str(spec)
    resolved = resolve_model_path(spec)
    known = find_known(spec)
    if isinstance(resolved, Path) and (resolved / "config.json").is_file():
        return _read_config(resolved / "config.json"), known.hf_id if known else str(spec)
    shipped = shipped_configs().get(str(spec).lower())
    if shipped is not None:
        return shipped, shipped.get("_name_or_path") or str(spec)
    try:
        from huggingface_hub import try_to_load_from_cache

        from kvhub.env import hf_hub_cache

        cached = try_to_load_from_cache(str(spec), "config.json", cache_dir=hf_hub_cache())
    except Exception:  # noqa: BLE001 - not a repo id huggingface_hub accepts
        cached = None
    if isinstance(cached, str):
        return _read_config(Path(cached)), str(spec)
    shipped_ids = sorted({c["_name_or_path"] for c in shipped_configs().values() if c.get("_name_or_path")})
    raise ConfigError(
        f"no config for {spec!r}: pass a config.json path or model directory, a model kvhub ships a "
        f"config for ({', '.join(shipped_ids)}), "
        "or a Hub id whose config is in the Hugging Face cache"
    )


def _read_config(path: Path) -> dict:
    """A config.json as a dict; ConfigError naming the file when it is unreadable, not JSON, or not an object."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{path} is not a readable JSON config ({exc}); pass a transformers config.json") from None
    if not isinstance(config, dict):
        raise ConfigError(
            f"{path} holds a JSON {type(config).__name__}, not an object; pass a transformers config.json"
        )
    return config


def kv_geometry(config: dict) -> dict:
    """What a fingerprint records of a model's KV cache, from its config dict: ``model_type``, ``num_layers``,
    ``num_kv_heads`` and ``head_dim`` (as :func:`kvhub.core.fingerprint.kv_geometry` derives them: the
    decoder's part of a multimodal config, KV heads defaulting to the attention heads, head_dim to
    hidden_size / heads); a field the config lacks is None."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    heads, hidden = text.get("num_attention_heads"), text.get("hidden_size")
    head_dim = text.get("head_dim") or (
        hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 else None
    )
    return {
        "model_type": config.get("model_type"),
        "num_layers": text.get("num_hidden_layers"),
        "num_kv_heads": text.get("num_key_value_heads") or heads,
        "head_dim": head_dim,
    }


KV_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "model_type")  # what must agree with a fingerprint


def geometry_differs(geometry: dict, fingerprint: dict) -> bool:
    """Whether a config's :func:`kv_geometry` contradicts a mapper fingerprint's (a field either lacks agrees)."""
    return any(geometry[key] is not None and geometry[key] != fingerprint.get(key) for key in KV_FIELDS)


def geometry_text(geometry: dict) -> str:
    """'24 layers, 2 KV heads of dim 64 (qwen2)'."""
    return (
        f"{geometry.get('num_layers')} layers, {geometry.get('num_kv_heads')} KV heads of dim "
        f"{geometry.get('head_dim')} ({geometry.get('model_type')})"
    )
