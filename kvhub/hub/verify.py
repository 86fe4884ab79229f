"""What a downloaded (or about to be published) artifact must satisfy before kvhub trusts it."""

from __future__ import annotations

import os

from kvhub.artifact import read_artifact
from kvhub.artifact.metadata import calibration_series
from kvhub.errors import IncompatibleError


def verify_artifact(directory: str | os.PathLike, *, source: str | None = None, target: str | None = None) -> dict:
    """Check an artifact directory before trusting it; returns its mapper.json.

    Every check of the format (kvhub.artifact.read_artifact: format version, every mapper.json field,
    fingerprints consistent with their configs, tensor names/shapes from the safetensors header, sha256,
    finite weights), and, when given, the source/target model ids (IncompatibleError).
    """
    metadata = read_artifact(directory)
    for role, wanted in (("source", source), ("target", target)):
        if wanted is not None and not same_model(metadata[role]["model_id"], wanted):
            raise IncompatibleError(
                f"{directory} maps {metadata['source']['model_id']} -> "
                f"{metadata['target']['model_id']}, not the {role} {wanted} you asked for"
            )
    return metadata


def same_model(model_id: str, wanted: str) -> bool:
    """``wanted`` names ``model_id``: the full id or its short name (after the '/'), case-insensitively."""
    return wanted.lower() in (model_id.lower(), model_id.rsplit("/", 1)[-1].lower())


def series_key(metadata: dict) -> tuple[str, str, str | None]:
    """(source id, target id, calibration name) of a mapper.json ('' for what it lacks; never raises)."""
    metadata = metadata if isinstance(metadata, dict) else {}

    def model(role: str) -> str:
        fingerprint = metadata.get(role)
        return str(fingerprint.get("model_id", "")).lower() if isinstance(fingerprint, dict) else ""

    calibration = metadata.get("calibration")
    name = calibration_series(calibration)  # calibration.series, or .name in older files
    return model("source"), model("target"), name if isinstance(name, str) else None
