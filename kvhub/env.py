"""What kvhub reads from the process it runs in, read at call time so that a process that changes its
environment (a notebook, a test) is honoured:

- :data:`VARIABLES`: every ``KVHUB_*`` environment variable kvhub reads, with its default, its meaning and
  the module that reads it (docs/configuration.md is checked against it: tests/contracts/test_docs.py);
- :func:`cache_root`: the root of kvhub's caches (models, corpora, calibration sets, checkpoints, evaluation
  sets and results): ``$KVHUB_CACHE``, else ``$XDG_CACHE_HOME/kvhub`` (default ``~/.cache/kvhub``).
  ``$KVHUB_HOME`` moves the store, not the caches (:mod:`kvhub.store.location`);
- :func:`env_flag`: a yes/no environment variable, read as huggingface_hub reads its own;
- :func:`hub_offline`: whether kvhub must stay off the Hugging Face Hub;
- :func:`hf_hub_cache`: the Hugging Face cache directory, read now;
- :func:`deshrink_override`: ``$KVHUB_DESHRINK``, how transfer reads the maps when no caller says
  (:mod:`kvhub.core.deshrink`);
- :func:`die_with_parent`: the pre-exec hook that ties a child process's life to this one.

The facts every stage needs (the cache root, the offline switch, the de-shrink default) are read here, so
none has to import a later stage for them.  A variable one module alone needs is read by that module (the
store's location, a fit's rank timeout, ...); :data:`VARIABLES` names it and its reader.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Variable:
    """One ``KVHUB_*`` environment variable: its default (in words), what it means, and who reads it."""

    name: str
    default: str
    meaning: str
    read_by: str


VARIABLES = (
    Variable(
        "KVHUB_CACHE",
        "`$XDG_CACHE_HOME/kvhub` (`~/.cache/kvhub`)",
        "Root of kvhub's caches: fetched models, corpora, calibration sets, fit checkpoints, evaluation sets "
        "and per-item evaluation results.",
        "kvhub.env",
    ),
    Variable(
        "KVHUB_HOME",
        "the user data directory (`~/.local/share/kvhub` on Linux)",
        "Where the default store lives (`kvhub.db`, `artifacts/`). It moves the store, not the caches.",
        "kvhub.store.location",
    ),
    Variable(
        "KVHUB_DB_URL",
        "`$KVHUB_HOME/kvhub.db`",
        "The store: a SQLAlchemy URL (`postgresql+psycopg://...`) or a SQLite file path. `--db` wins over it.",
        "kvhub.store.location",
    ),
    Variable(
        "KVHUB_ARTIFACTS",
        "`$KVHUB_HOME/artifacts`",
        "The artifact directory of a server (PostgreSQL) store; a SQLite store keeps its artifacts beside "
        "its file. Machines sharing one PostgreSQL store share this directory too.",
        "kvhub.store.location",
    ),
    Variable(
        "KVHUB_DESHRINK",
        "`kv`",
        "How transfer reads the maps when no caller says: `kv`, `v` or `off` (a whole process's default).",
        "kvhub.env",
    ),
    Variable(
        "KVHUB_HUB_NAMESPACES",
        "none",
        "Comma-separated Hub users or organisations `kvhub.load()` searches when the local store misses.",
        "kvhub.hub.pull",
    ),
    Variable(
        "KVHUB_PROGRESS_INTERVAL",
        "`30`",
        "Seconds between plain progress lines (off a terminal, or with `HF_HUB_DISABLE_PROGRESS_BARS`).",
        "kvhub.cli.progress",
    ),
    Variable(
        "KVHUB_VLLM",
        "`vllm` on PATH, else `.venv-vllm/bin/vllm`",
        "The vLLM executable `kvhub serve` launches; `--vllm` wins over it.",
        "kvhub.serving.launch",
    ),
    Variable(
        "KVHUB_DIST_TIMEOUT",
        "`1800`",
        "Seconds a rank of a distributed fit waits for the others (e.g. for one that died).",
        "kvhub.fitting.distributed",
    ),
    Variable(
        "KVHUB_FIT_LAUNCHER",
        "set by kvhub",
        "Internal: the pid of the `kvhub fit --distributed` whose torchrun started a rank; the rank exits when it "
        "dies. Not for users to set.",
        "kvhub.fitting.distributed",
    ),
)


def cache_root() -> Path:
    """Root of kvhub's caches: $KVHUB_CACHE, else $XDG_CACHE_HOME/kvhub."""
    if os.environ.get("KVHUB_CACHE"):
        return Path(os.environ["KVHUB_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "kvhub"


def env_flag(name: str) -> bool:
    """True when the environment variable ``name`` says yes now (1, true, yes, on; any case), as
    huggingface_hub reads its own flags."""
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def deshrink_override() -> str | None:
    """``$KVHUB_DESHRINK`` (``kv``, ``v`` or ``off``; checked by :func:`kvhub.core.deshrink.deshrink_setting`), None
    when unset or empty."""
    return os.environ.get("KVHUB_DESHRINK", "").strip() or None


def hub_offline() -> bool:
    """Whether kvhub must stay off the Hub: ``HF_HUB_OFFLINE`` set now, or huggingface_hub's own flag
    (which it read from the environment when it was imported)."""
    from huggingface_hub import constants

    return env_flag("HF_HUB_OFFLINE") or bool(constants.HF_HUB_OFFLINE)


def hf_hub_cache() -> str:
    """The Hugging Face cache directory as huggingface_hub would read it now: ``$HF_HUB_CACHE``, else
    ``$HF_HOME/hub``, else the one huggingface_hub read when it was imported."""
    from huggingface_hub import constants

    cache = os.environ.get("HF_HUB_CACHE") or (
        os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME") else constants.HF_HUB_CACHE
    )
    return os.path.expanduser(cache)


def die_with_parent() -> Callable[[], object] | None:
    """A pre-exec hook that has the kernel SIGTERM the child when this process dies, even by SIGKILL
    (Linux; None elsewhere).  libc is loaded here, in the parent: the hook itself only makes the system
    call, which is all a pre-exec hook may safely do."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
