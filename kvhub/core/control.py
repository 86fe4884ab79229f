"""The no-information control of a mapper: a map that knows nothing about the context.

Every weight is zero and every bias is the calibration mean of the target layer's RoPE-stripped keys
/ values (``{k,v}.{m}.target_mean``, written by :func:`kvhub.fitting.fit.build_mapper`), the best constant
prediction (R^2 = 0).  Its cache holds the right shapes, norms and positions but no content, so
whatever a handoff scores from it is what the exact recomputes and the target's priors give; what
the real map scores above it is what the mapped context contributes.  ``kvhub eval``'s long-context
and gist tasks (:mod:`kvhub.eval.longctx`, :mod:`kvhub.eval.gist`) score it beside every mapped variant
with the same recompute; its multiple-choice and perplexity tasks do not (the lm-eval model's
``condition=control`` scores it on any lm-eval task).  The vLLM connector maps a request with it when
the request asks (``kvhub_control``, which ``kvhub eval-serve`` sends); it lives in the core so that
eval and serving reach it downward.
"""

from __future__ import annotations

import torch

from kvhub.artifact import map_prefix, tensor_name
from kvhub.core.mapper import Mapper
from kvhub.errors import ConfigError


def control_mapper(mapper):
    """A Mapper of the same metadata and layers whose cache is the constant mean K/V (module docstring).

    Each target layer reads one source layer through a zero (in, out) weight, so the control costs
    one small GEMM per layer whatever the real map's structure.
    """
    tensors, layers = {}, []
    width_in = mapper.source["num_kv_heads"] * mapper.source["head_dim"]
    for layer in mapper.layers:
        m = layer["target"]
        for kind in ("k", "v"):
            prefix = map_prefix(kind, m)
            mean = mapper.tensors.get(tensor_name(prefix, "target_mean"))
            if mean is None:
                raise ConfigError(
                    f"{mapper.source['model_id']} -> {mapper.target['model_id']}: this mapper stores no calibration "
                    "mean of the target's K/V (target_mean tensors, written by kvhub >= 0.2 fits), so it has no "
                    "no-information control; refit it with `kvhub fit` to get one"
                )
            tensors[tensor_name(prefix, "weight")] = torch.zeros(
                width_in, mean.shape[0], dtype=mean.dtype, device=mean.device
            )  # (d_in, d_out)
            tensors[tensor_name(prefix, "bias")] = mean.clone()
            tensors[tensor_name(prefix, "target_mean")] = mean.clone()
        layers.append({**layer, "sources": layer["sources"][:1], "r2_k": 0.0, "r2_v": 0.0})
    metadata = {key: value for key, value in mapper.metadata.items() if key != mapper.kind.block}
    metadata.update(kind="ridge", layers=layers, notes=["control: zero weights, bias = mean target K/V"])
    return Mapper(tensors, metadata, dtype=mapper.dtype, compute_dtype=mapper.compute_dtype, deshrink="off")
