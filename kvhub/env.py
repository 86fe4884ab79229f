"""What kvhub reads from the process it runs in, read at call time so that a process that changes its
environment (a notebook, a test) is honoured:

- :func:`cache_root`: the root of kvhub's caches (models, corpora, calibration sets, checkpoints, evaluation
  sets and results): ``$KVHUB_CACHE``, else ``$XDG_CACHE_HOME/kvhub`` (default ``~/.cache/kvhub``).
  ``$KVHUB_HOME`` moves the store, not the caches (:mod:`kvhub.store.location`);
- :func:`env_flag`: a yes/no environment variable, read as huggingface_hub reads its own;
- :func:`hub_offline`: whether kvhub must stay off the Hugging Face Hub;
- :func:`deshrink_override`: ``$KVHUB_DESHRINK``, how transfer reads the maps when no caller says
  (:mod:`kvhub.core.deshrink`);
- :func:`die_with_parent`: the pre-exec hook that ties a child process's life to this one.

Every stage reads these here, so none has to import a later stage for an environment fact.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path


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


def die_with_parent() -> Callable[[], object] | None:
    """A pre-exec hook that has the kernel SIGTERM the child when this process dies, even by SIGKILL
    (Linux; None elsewhere).  libc is loaded here, in the parent: the hook itself only makes the system
    call, which is all a pre-exec hook may safely do."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
