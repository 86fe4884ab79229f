"""Model fingerprints: what a mapper is valid for.

A fingerprint is a plain dict (JSON-ready) describing one model:

    model_id, revision, model_type, family, config_hash, tokenizer_hash,
    num_layers, num_kv_heads, head_dim, rope, layer_types, config

``config_hash`` is sha256 of the sorted-JSON config with volatile keys (paths, dtype, versions)
removed; ``tokenizer_hash`` is sha256 of the sorted vocabulary plus special tokens; ``config`` keeps
the reduced config dict so the rotary module can be rebuilt without the model.
"""

from __future__ import annotations

from kvhub.artifact import json_sha256 as _sha256_json  # the format owns how config_hash hashes a config
from kvhub.core.rope import SUPPORTED_MODEL_TYPES, check_supported

_VOLATILE_KEYS = {
    "_name_or_path",
    "name_or_path",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "_commit_hash",
    "_attn_implementation_autoset",
    "_attn_implementation",
    "use_cache",
    "quantization_config",
    "architectures",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
}


def reduced_config(config) -> dict:
    """The config as a dict without keys that do not change the computation."""
    return {k: v for k, v in sorted(config.to_dict().items()) if k not in _VOLATILE_KEYS}


def kv_geometry(config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a decoder config (Qwen2 has head_dim=None)."""
    config = config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


def tokenizer_hash(tokenizer) -> str | None:
    """sha256 of the vocabulary (sorted token -> id) and the special tokens; None without a tokenizer."""
    if tokenizer is None:
        return None
    vocab = sorted(tokenizer.get_vocab().items())
    specials = sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", []))
    return _sha256_json({"vocab": vocab, "special": specials})


def model_fingerprint(config, *, model_id: str, revision: str | None = None, tokenizer=None) -> dict:
    """Fingerprint dict of a model from its config (and tokenizer when given)."""
    check_supported(config)
    layers, kv_heads, head_dim = kv_geometry(config)
    reduced = reduced_config(config)
    return {
        "model_id": model_id,
        "revision": revision,
        "model_type": config.model_type,
        "family": SUPPORTED_MODEL_TYPES[config.model_type],
        "config_hash": _sha256_json(reduced),
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "num_layers": layers,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "rope": dict(getattr(config, "rope_parameters", None) or {}),
        "layer_types": list(getattr(config, "layer_types", None) or []),
        "config": reduced,
    }


def config_from_fingerprint(fingerprint: dict):
    """Rebuild a transformers config from a fingerprint's reduced config."""
    from transformers import AutoConfig

    config = dict(fingerprint["config"])
    model_type = config.pop("model_type", fingerprint["model_type"])
    return AutoConfig.for_model(model_type, **config)
