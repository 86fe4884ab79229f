"""Control for the exact-recompute levers: a mapper that knows nothing about the context.

    python benchmarks/mean_map.py --like ~/.cache/kvhub/bench/core-legal-docs-128 \
        --stats ~/.cache/kvhub/bench/stats/legal-docs-ec3facac9bb0e87e-s4.safetensors \
        --out ~/.cache/kvhub/bench/mean-map-legal
    kvhub import ~/.cache/kvhub/bench/mean-map-legal
    kvhub eval ...:control-mean-kv@v1 --task hellaswag --limit 300 --exact-prefix 4 --exact-suffix 8

Same shapes, sources and metadata as ``--like``, but every weight is zero and every bias is the mean
target key (RoPE-stripped) / value of the calibration statistics: the best constant prediction
(R^2 = 0).  With exact_prefix/exact_suffix, what the real mapper scores above this control is what
its mapped middle of the context contributes beyond the recomputed tokens.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--like", type=Path, required=True, help="mapper artifact to copy shapes/metadata from")
    parser.add_argument("--stats", type=Path, required=True, help="statistics file of benchmarks/domain_matrix.py")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import torch
    from safetensors.torch import load_file

    from kvhub.core.mapper import Mapper

    like = Mapper.load(args.like)
    state = load_file(str(args.stats))
    width = like.target["num_kv_heads"] * like.target["head_dim"]
    means = {"k": state["train.k.mean_y"], "v": state["train.v.mean_y"]}
    tensors = {}
    for name, tensor in like.tensors.items():
        kind, layer, field = name.split(".")
        if field == "bias":
            tensors[name] = means[kind][int(layer) * width:(int(layer) + 1) * width].float().clone()
        else:
            tensors[name] = torch.zeros_like(tensor)
    metadata = {key: value for key, value in like.metadata.items() if key not in ("tensors", "format_version")}
    metadata["calibration"] = {**metadata.get("calibration", {}), "name": "control-mean-kv"}
    metadata["kind"] = "ridge"
    metadata["notes"] = ["control: zero weights, bias = mean target K/V of the calibration statistics"]
    metadata["metrics"] = {"train_tokens": metadata["metrics"].get("train_tokens", 0)}
    for layer in metadata["layers"]:
        layer.update({"r2_k": 0.0, "r2_v": 0.0, "train_r2_k": 0.0, "train_r2_v": 0.0})
    Mapper(tensors, metadata).save(args.out, overwrite=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
