"""An artifact directory: reading it (every check of the format), writing it, and which files it holds.

    mapper.json          metadata (kvhub.artifact.metadata)
    mapper.safetensors   the tensors (kvhub.artifact.tensors); mapper.json's ``tensors.file``
    README.md            a model card (optional; written by push)
    *.png *.jpg *.jpeg *.svg   figures (optional; shown on the card)

Every file is a regular file directly in the directory; nothing is read through a symbolic link.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvhub import __version__
from kvhub.errors import ArtifactError, IntegrityError, InvalidArtifactError, NonFiniteError
from kvhub.artifact.files import AtomicDirectory, open_regular, refused_when_full, sha256_file
from kvhub.artifact.metadata import METADATA_FILE, TENSORS_FILE, check_metadata, is_plain_file_name, parse_json
from kvhub.artifact.tensors import TensorFile, check_tensors, format_version_of, read_tensor_file

CARD_FILE = "README.md"
FIGURE_SUFFIXES = (".png", ".jpg", ".jpeg", ".svg")
METADATA_LIMIT = 64 << 20  # bytes of mapper.json read at most


def is_figure_name(name: str) -> bool:
    """A plain file name with a figure suffix (``heatmap.png``)."""
    return is_plain_file_name(name) and name.lower().endswith(FIGURE_SUFFIXES)


def parse_metadata_bytes(data: bytes, *, where: str) -> dict:
    """mapper.json bytes -> checked metadata (UTF-8, JSON, kvhub.artifact.metadata.check_metadata)."""
    try:
        metadata = parse_json(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InvalidArtifactError(
            f"{where}: {METADATA_FILE} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
            "the artifact is corrupt, re-fetch it or re-fit the mapper",
            field="",
        ) from None
    except ValueError as exc:
        raise InvalidArtifactError(
            f"{where}: {METADATA_FILE} is not valid JSON ({exc}); the artifact is corrupt, "
            "re-fetch it or re-fit the mapper",
            field="",
        ) from None
    return check_metadata(metadata, where=where)


def read_metadata(directory: str | os.PathLike) -> dict:
    """Read and check mapper.json (every field; not the tensor bytes, see :func:`verify_tensors`)."""
    path = Path(directory) / METADATA_FILE
    if not os.path.lexists(path):
        raise ArtifactError(f"{directory} is not a kvhub mapper artifact: {METADATA_FILE} is missing")
    with open_regular(path) as handle:
        data = handle.read(METADATA_LIMIT + 1)
    if len(data) > METADATA_LIMIT:
        raise InvalidArtifactError(f"{path} is larger than {METADATA_LIMIT >> 20} MB; not a kvhub mapper.json")
    return parse_metadata_bytes(data, where=str(directory))


def tensor_path(directory: str | os.PathLike, metadata: dict) -> Path:
    """The tensor file mapper.json names: a plain name, so always directly inside ``directory``."""
    name = metadata["tensors"]["file"]
    if not is_plain_file_name(name):  # check_metadata refuses it too; this guards callers that skipped it
        raise InvalidArtifactError(f"{directory}: tensors.file {name!r} is not a plain file name", field="tensors.file")
    return Path(directory) / name


def verify_tensors(directory: str | os.PathLike, metadata: dict) -> TensorFile:
    """Raise unless the tensor file's sha256 is mapper.json's, its header names exactly the tensors and
    shapes mapper.json implies, and every value is finite.  One pass over the bytes."""
    path = tensor_path(directory, metadata)
    recorded = metadata["tensors"]["sha256"]
    try:
        found = read_tensor_file(path, where=str(path))
    except InvalidArtifactError:
        actual = sha256_file(path)
        if actual != recorded:  # a damaged file: say so rather than describe the damage
            raise _sha_mismatch(path, actual, recorded) from None
        raise
    if found.sha256 != recorded:
        raise _sha_mismatch(path, found.sha256, recorded)
    if found.nonfinite:
        raise InvalidArtifactError(
            f"{path}: tensor {', '.join(found.nonfinite[:4])} holds NaN or Inf; the mapper "
            "would produce a broken cache, re-fit it",
            field="tensors",
        )
    check_tensors(found.shapes, metadata, where=str(path))
    return found


def _sha_mismatch(path: Path, actual: str | None, recorded: str) -> IntegrityError:
    return IntegrityError(
        f"{path} has sha256 {actual}, but mapper.json records {recorded}: the file was modified "
        "or corrupted; re-fetch it (kvhub pull) or re-fit"
    )


def read_artifact(directory: str | os.PathLike) -> dict:
    """Every check of the format on an artifact directory (mapper.json, then the tensor file);
    returns the metadata.  ArtifactError (or a subclass) names the problem."""
    metadata = read_metadata(directory)
    verify_tensors(directory, metadata)
    return metadata


def publishable_files(directory: str | os.PathLike, metadata: dict) -> list[str]:
    """Names of the files of an artifact that may leave this machine: mapper.json, the tensor file,
    and figures; each a regular file directly in ``directory`` (links and anything else are skipped)."""
    directory = Path(directory)
    names = [METADATA_FILE, metadata["tensors"]["file"]]
    names += sorted(
        p.name for p in directory.iterdir() if is_figure_name(p.name) and not p.is_symlink() and p.is_file()
    )
    return names


def write_artifact(directory: str | os.PathLike, tensors: dict, metadata: dict, *, overwrite: bool = False) -> dict:
    """Write ``tensors`` (name -> CPU fp32 torch tensor) and ``metadata`` as an artifact, atomically.

    Sets ``format_version``, ``kvhub_version`` (unless set) and ``tensors``; checks the result like a
    reader would before it is renamed into place.  Returns the metadata written.
    """
    import torch
    from safetensors.torch import save_file

    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    nonfinite = sorted(name for name, t in tensors.items() if not bool(torch.isfinite(t).all()))
    if nonfinite:
        raise NonFiniteError(
            f"tensor {', '.join(nonfinite[:4])} holds NaN or Inf; not writing {directory} "
            "(the fit diverged: try a larger --lambda)"
        )
    folder = Path(directory).absolute().parent
    full = refused_when_full(
        folder,
        then=f"{directory} was not written (nothing half-written is left); free some "
        "space there or write it to another directory",
    )
    with full, AtomicDirectory(directory, overwrite=overwrite) as tmp:
        save_file(tensors, str(tmp / TENSORS_FILE), metadata={"format": "pt"})
        metadata = dict(metadata)
        metadata["format_version"] = format_version_of(shapes)
        metadata.setdefault("kvhub_version", __version__)
        metadata["tensors"] = {
            "file": TENSORS_FILE,
            "sha256": sha256_file(tmp / TENSORS_FILE),
            "bytes": (tmp / TENSORS_FILE).stat().st_size,
        }
        text = json.dumps(metadata, indent=2, sort_keys=True) + "\n"
        parse_metadata_bytes(text.encode(), where=f"writing {directory}")
        check_tensors(shapes, metadata, where=f"writing {directory}")
        (tmp / METADATA_FILE).write_text(text, encoding="utf-8")
    return metadata


def replaceable_artifact_dir(directory: str | os.PathLike) -> bool:
    """Whether ``Mapper.save_pretrained`` may replace ``directory``: True for a kvhub artifact directory
    (mapper.json and nothing but artifact files: tensors, card, figures) or an empty one, False when it
    does not exist; ArtifactError for anything else, which is never overwritten."""
    path = Path(directory).expanduser()
    if not os.path.lexists(path):
        return False
    names = sorted(p.name for p in path.iterdir()) if path.is_dir() and not path.is_symlink() else None
    foreign = (
        None
        if names is None
        else [
            n for n in names if not (n in (METADATA_FILE, CARD_FILE) or n.endswith(".safetensors") or is_figure_name(n))
        ]
    )
    if names is None or foreign or (names and METADATA_FILE not in names):
        what = (
            "is not a directory" if names is None else f"holds {(foreign or names)[0]!r}, which no kvhub artifact has"
        )
        raise ArtifactError(
            f"{path} exists and {what}; save_pretrained replaces only a kvhub artifact directory "
            "(or an empty one): choose a new directory"
        )
    return True
