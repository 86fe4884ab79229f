"""What a vLLM engine must be for the kvhub connector, checked at start-up: one rank holding every KV head
of every layer, and a model whose layers all cache per-token attention K/V.

Tensor parallelism (and pipeline or context parallelism) is refused, not half-served: each tensor-parallel
worker holds only its shard of the KV heads, so a producer rank would store a fraction of the heads under a
key the other ranks write too, and a consumer rank would get a map of all target heads (whose inputs are every
source head, spread over the producer's ranks) for blocks that hold its shard only; the selection of the
recompute reads all heads on one rank.  Serving under TP would need the producer to gather heads (or store
one shard per rank) and each consumer rank to map and write its own slice: not built.  Data parallelism
(several full replicas) keeps all heads on each engine and is not refused (untested).

Hybrid models (linear-attention, Mamba or convolution layers) are refused by layer type:
:mod:`kvhub.core.layer_kinds`.  No vLLM import: the checks read only the config objects vLLM hands over.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from kvhub.core.layer_kinds import check_attention_layers
from kvhub.errors import ConfigError, IncompatibleError

# vllm serve's flags that split one engine's model (and so its KV cache) over several ranks
PARALLEL_FLAGS = {
    "--tensor-parallel-size": "tensor",
    "-tp": "tensor",
    "--pipeline-parallel-size": "pipeline",
    "-pp": "pipeline",
    "--decode-context-parallel-size": "decode context",
    "-dcp": "decode context",
    "--prefill-context-parallel-size": "prefill context",
    "-pcp": "prefill context",
}
PARALLEL_FIELDS = {
    "tensor_parallel_size": "tensor",
    "pipeline_parallel_size": "pipeline",
    "decode_context_parallel_size": "decode context",
    "prefill_context_parallel_size": "prefill context",
}

WHY_ONE_RANK = (
    "the kvhub connector needs each engine's KV cache on one rank: under tensor parallelism each "
    "worker holds only its shard of the KV heads, and the connector neither gathers the source's "
    "heads nor writes a per-rank slice of the mapped ones"
)


def parallel_refusal(kind: str, size: int, *, origin: str) -> ConfigError:
    return ConfigError(
        f"{origin}: {kind} parallel size {size} is not supported; {WHY_ONE_RANK}. Serve each model "
        "on one GPU (a model too large for one GPU cannot be a kvhub cascade's engine yet), or run "
        "several single-GPU replicas (data parallelism) instead"
    )


def check_parallel_args(args: Sequence[str]) -> None:
    """Refuse ``vllm serve`` arguments (``kvhub serve``'s passthrough after ``--``) that split the model over
    ranks: ``--tensor-parallel-size N`` / ``-tp N`` (and ``=N``, underscores), pipeline and context parallelism."""
    args = list(args)
    for index, arg in enumerate(args):
        flag, _, inline = arg.partition("=")
        flag = flag.replace("_", "-") if flag.startswith("--") else flag
        kind = PARALLEL_FLAGS.get(flag)
        if kind is None:
            continue
        value = inline if inline else (args[index + 1] if index + 1 < len(args) else "")
        try:
            size = int(value)
        except ValueError:
            raise ConfigError(f"vllm argument {arg} needs a whole number after it, got {value!r}") from None
        if size > 1:
            raise parallel_refusal(kind, size, origin=f"the vllm argument {flag} {size}")


def check_engine(vllm_config) -> None:
    """The connector's start-up check of its engine (either role, scheduler or worker side): one rank per
    model (:data:`PARALLEL_FIELDS` all 1) and an attention-only model; ConfigError / UnsupportedModelError."""
    parallel = getattr(vllm_config, "parallel_config", None)
    for field, kind in PARALLEL_FIELDS.items():
        size = getattr(parallel, field, 1)
        if isinstance(size, int) and size > 1:
            raise parallel_refusal(kind, size, origin=f"KVHubConnector ({field}={size})")
    model_config = getattr(vllm_config, "model_config", None)
    hf_config = getattr(model_config, "hf_config", None)
    if hf_config is not None:
        check_attention_layers(hf_config, name=getattr(model_config, "model", None))


def check_served_model(model: str | os.PathLike) -> None:
    """``kvhub serve``'s check of a model it is about to hand to vLLM: a local directory whose config.json
    names linear-attention / Mamba / convolution layers is refused by layer type; anything else (a Hub id, a
    config that does not read) is left to the engine, whose connector checks the same at start-up."""
    path = Path(model).expanduser()
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return
    if isinstance(config, dict):
        check_attention_layers(config, name=str(model))


# The head sizes vLLM's CPU attention backend computes (vllm/v1/attention/backends/cpu_attn.py,
# ``get_supported_head_sizes``, vLLM 0.32).  An engine of another head size starts and reports ready, then
# fails at its first request ("Unsupported CPU attention configuration: head_dim=16").
CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def cpu_head_size_warning(head_dims: dict[str, tuple[str, int | None]]) -> str | None:
    """The warning for CPU engines whose model's head size vLLM's CPU attention lacks, from ``{server name:
    (model id, head_dim)}``; None when every head size is supported (or unknown)."""
    bad = [
        f"the {name} model {model_id} has {head_dim}"
        for name, (model_id, head_dim) in head_dims.items()
        if isinstance(head_dim, int) and head_dim not in CPU_ATTENTION_HEAD_SIZES
    ]
    if not bad:
        return None
    sizes = ", ".join(map(str, CPU_ATTENTION_HEAD_SIZES))
    return (
        f"vLLM's CPU attention computes head sizes {sizes} only, and {' and '.join(bad)}: such an engine starts, "
        "then fails at its first request. Serve on a GPU, or models of a supported head size"
    )


def check_served_models(metadata: dict, served: dict[str, tuple[str, str]]) -> None:
    """The models a cascade serves instead of the mapper's own (``{server name: (option, model)}``, e.g.
    ``{"small": ("--small-model", "./other")}``) must have the KV geometry the mapper was fitted on: the
    small server stores caches the map reads, the large one is written the map's output.  IncompatibleError
    naming both models when a config kvhub reads offline (:func:`kvhub.models.configs.load_config`) differs;
    a model with no such config is left to the engine, whose connector checks the same at start-up."""
    from kvhub.models.configs import geometry_differs, geometry_text, kv_geometry, load_config

    roles = {"small": "source", "large": "target"}
    for name, (option, model) in served.items():
        try:
            config, _ = load_config(model)
        except ConfigError:
            continue
        geometry, fingerprint = kv_geometry(config), metadata[roles[name]]
        if geometry_differs(geometry, fingerprint):
            raise IncompatibleError(
                f"{option} {model} is not the model the mapper was fitted on: it has {geometry_text(geometry)}, "
                f"the mapper's {roles[name]} {fingerprint['model_id']} has {geometry_text(fingerprint)}; serve "
                f"that model (leave {option} out) or a mapper fitted for {model}"
            )
