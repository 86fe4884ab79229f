"""What a downloaded (or about to be published) artifact must satisfy before kvhub trusts it."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import IncompatibleError, IntegrityError
from ..fingerprint import _sha256_json
from ..mapper import read_metadata, verify_tensors


def verify_artifact(directory: str | os.PathLike, *, source: str | None = None, target: str | None = None) -> dict:
    """Check an artifact directory before trusting it; returns its mapper.json.

    Format version (FormatVersionError), sha256 of the tensors (IntegrityError), fingerprints
    consistent with their configs and with the tensor shapes (IntegrityError), and, when given,
    the source/target model ids (IncompatibleError).
    """
    metadata = read_metadata(directory)
    verify_tensors(directory, metadata)
    check_fingerprints(directory, metadata)
    for role, wanted in (("source", source), ("target", target)):
        if wanted is not None and not same_model(metadata[role]["model_id"], wanted):
            raise IncompatibleError(f"{directory} maps {metadata['source']['model_id']} -> "
                                    f"{metadata['target']['model_id']}, not the {role} {wanted} you asked for")
    return metadata


def same_model(model_id: str, wanted: str) -> bool:
    """``wanted`` names ``model_id``: the full id or its short name (after the '/'), case-insensitively."""
    return wanted.lower() in (model_id.lower(), model_id.rsplit("/", 1)[-1].lower())


def check_fingerprints(directory: str | os.PathLike, metadata: dict) -> None:
    """Each fingerprint's config_hash matches its config; layer indices and tensor shapes match both."""
    from safetensors import safe_open

    for role in ("source", "target"):
        fp = metadata.get(role) or {}
        missing = [k for k in ("model_id", "config", "config_hash", "num_layers", "num_kv_heads", "head_dim")
                   if k not in fp]
        if missing:
            raise IntegrityError(f"mapper.json in {directory}: the {role} fingerprint lacks {missing}; re-fetch it")
        if _sha256_json(fp["config"]) != fp["config_hash"]:
            raise IntegrityError(f"mapper.json in {directory}: the {role} fingerprint's config does not hash to "
                                 f"its config_hash; the file was edited or corrupted, re-fetch it")
    src, dst = metadata["source"], metadata["target"]
    with safe_open(str(Path(directory) / metadata["tensors"]["file"]), framework="pt") as handle:
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    expected = {}
    for layer in metadata.get("layers", []):
        m, sources = layer["target"], layer["sources"]
        if not 0 <= m < dst["num_layers"] or not all(0 <= s < src["num_layers"] for s in sources):
            raise IntegrityError(f"mapper.json in {directory}: layer {m} <- {sources} is outside the fingerprints' "
                                 f"{src['num_layers']} / {dst['num_layers']} layers")
        d_in = len(sources) * src["num_kv_heads"] * src["head_dim"]
        d_out = dst["num_kv_heads"] * dst["head_dim"]
        for kind in ("k", "v"):
            expected[f"{kind}.{m}.weight"], expected[f"{kind}.{m}.bias"] = (d_in, d_out), (d_out,)
            if f"{kind}.{m}.target_mean" in shapes:  # optional: the no-information control's constants
                expected[f"{kind}.{m}.target_mean"] = (d_out,)
    if shapes != expected:
        wrong = sorted(set(shapes.items()) ^ set(expected.items()))[:4]
        raise IntegrityError(f"{directory}: tensor names or shapes disagree with the fingerprints ({wrong}); "
                             "the artifact is inconsistent, re-fetch or re-fit it")


def series_key(metadata: dict) -> tuple[str, str, str | None]:
    """(source id, target id, calibration name) of a mapper.json ('' for what it lacks)."""
    def model(role: str) -> str:
        return str((metadata.get(role) or {}).get("model_id", "")).lower()

    return model("source"), model("target"), (metadata.get("calibration") or {}).get("name")
