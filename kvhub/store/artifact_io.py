"""Reading and copying a stored version's artifact files: which file holds its tensors (trusted by the hash
recorded for it, so a load hashes those bytes once), and an export that verifies every byte it copies."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvhub.artifact import AtomicDirectory, is_plain_file_name, open_regular
from kvhub.artifact.files import NO_SPACE
from kvhub.errors import ArtifactError
from kvhub.errors import IntegrityError as ArtifactIntegrityError
from kvhub.store.artifacts import artifact_files, copy_hashing, manifest_sha256
from kvhub.store.engine import no_space_error
from kvhub.store.records import MapperVersion


def trusted_tensor_file(metadata_path: Path, tensors_sha256: str) -> str:
    """The tensor file's name that mapper.json at ``metadata_path`` gives, if it records ``tensors_sha256``
    too; "" otherwise (the verify that follows then reports the missing or altered file)."""
    try:
        with open_regular(metadata_path) as handle:
            tensors = json.loads(handle.read())["tensors"]
    except (ArtifactError, ValueError, KeyError, TypeError):
        return ""
    if not isinstance(tensors, dict) or tensors.get("sha256") != tensors_sha256:
        return ""
    name = tensors.get("file", "")
    return name if is_plain_file_name(name) else ""


def export_artifact(
    source: Path, directory: str | os.PathLike, *, record: MapperVersion, overwrite: bool = False
) -> Path:
    """Copy the verified artifact at ``source`` to ``directory`` (atomically), checking the bytes copied
    against ``record``'s content address."""
    try:
        with AtomicDirectory(directory, overwrite=overwrite) as tmp:
            hashes = {name: copy_hashing(path, tmp / name) for name, path in artifact_files(source).items()}
            if manifest_sha256(hashes) != record.artifact_sha256:
                raise ArtifactIntegrityError(
                    f"artifact of {record.ref} changed on disk (manifest {manifest_sha256(hashes)}, recorded "
                    f"{record.artifact_sha256}); nothing was exported. Re-import or pull it again"
                )
    except OSError as exc:
        if exc.errno not in NO_SPACE:
            raise
        raise no_space_error(
            Path(directory).absolute().parent,
            then=(
                f"nothing was exported ({record.artifact_bytes} bytes of {record.ref}). Free some space there or "
                "export to another directory"
            ),
        ) from exc
    return Path(directory)
