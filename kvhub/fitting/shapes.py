"""Model shapes for the plan: the parts of a decoder config that decide a fit's cost, read without weights.

:func:`kvhub.models.configs.load_config` finds a config for a model spec (a config.json or model directory, a
fetched known model, a config kvhub ships, or the Hugging Face cache, offline); :class:`ModelShape` keeps the fields
the plan's formulas (:mod:`kvhub.fitting.plan`) use: layers, widths, heads, and the parameter and
forward-FLOP counts built from them.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

from kvhub.core.layer_kinds import check_attention_layers
from kvhub.errors import ConfigError
from kvhub.models.configs import load_config, shipped_configs  # noqa: F401 (the plan reads configs through them)


@dataclass(frozen=True)
class ModelShape:
    """The parts of a decoder config that decide a fit's cost."""

    model_id: str
    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    max_positions: int | None = None  # max_position_embeddings, when the config says (a positive integer)

    @classmethod
    def from_config(cls, config: dict, *, model_id: str | None = None) -> "ModelShape":
        """The shape a transformers config (a dict) describes; ConfigError naming a missing or wrong field."""
        name = model_id or (config.get("_name_or_path") if isinstance(config, dict) else None) or "the model"
        if not isinstance(config, dict):
            raise ConfigError(
                f"config of {name} is {type(config).__name__}, not a JSON object; kvhub plan reads "
                "decoder configs (transformers config.json)"
            )
        if config.get("text_config"):  # a multimodal config: the decoder's part
            if not isinstance(config["text_config"], dict):
                raise ConfigError(f"config of {name}: `text_config` must be a JSON object")
            config = config["text_config"]
        check_attention_layers(config, name=name)  # linear-attention / Mamba / conv layers: refused by type
        field = functools.partial(_geometry_field, config, name)
        heads, hidden = field("num_attention_heads"), field("hidden_size")
        head_dim = field("head_dim", required=False) or hidden // heads
        if head_dim < 1:
            raise ConfigError(
                f"config of {name}: hidden_size {hidden} is smaller than num_attention_heads {heads}; "
                "set head_dim or fix the config"
            )
        model_type = config.get("model_type") if isinstance(config.get("model_type"), str) else ""
        return cls(
            model_id=model_id or config.get("_name_or_path") or model_type,
            model_type=model_type,
            layers=field("num_hidden_layers"),
            hidden=hidden,
            heads=heads,
            kv_heads=field("num_key_value_heads", required=False) or heads,
            head_dim=head_dim,
            intermediate=field("intermediate_size"),
            vocab=field("vocab_size"),
            tied=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=bool(config.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type.startswith("qwen3"),
            max_positions=_positive_or_none(config.get("max_position_embeddings")),
        )

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def matmul_parameters(self) -> int:
        """Weights of one decoder layer's matrix products: q/k/v/o and the gated MLP."""
        q_width = self.heads * self.head_dim
        return self.hidden * (q_width + 2 * self.kv_width) + q_width * self.hidden + 3 * self.hidden * self.intermediate

    def layer_parameters(self) -> int:
        """Parameters of one decoder layer: matmul weights, q/k/v biases (Qwen2), norms (and Qwen3's q/k norms)."""
        bias = (self.heads * self.head_dim + 2 * self.kv_width) if self.qkv_bias else 0
        norms = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        return self.matmul_parameters() + bias + norms

    def parameters(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return embeddings + self.layers * self.layer_parameters() + self.hidden

    def forward_flops(self, tokens: int) -> int:
        """Matmul FLOPs of the model body over one sequence of ``tokens`` tokens (module docstring)."""
        return (
            2 * tokens * self.layers * self.matmul_parameters()
            + 4 * self.layers * self.heads * self.head_dim * tokens * tokens
        )


def _positive_or_none(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _geometry_field(config: dict, name: str, key: str, *, required: bool = True) -> int | None:
    """``config[key]`` as a positive integer (None when absent or null and not ``required``)."""
    value = config.get(key)
    if value is None:
        if required:
            raise ConfigError(
                f"config of {name} has no {key!r}; kvhub plan reads decoder configs (transformers config.json)"
            )
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"config of {name}: `{key}` is {json.dumps(value)[:40]}, not a positive integer; fix the config.json"
        )
    return value


def shape_of(spec: str) -> ModelShape:
    """The :class:`ModelShape` of a model spec (see :func:`load_config`)."""
    config, model_id = load_config(spec)
    return ModelShape.from_config(config, model_id=model_id)
