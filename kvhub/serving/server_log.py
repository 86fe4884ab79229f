"""What a server's log says when the server dies: its error, not the shutdown messages that follow it.

A vLLM server whose engine raises logs the traceback, then its API server's consequences and about a
hundred lines of shutdown chatter (``[shutdown] force killing ...``, multiprocessing's resource tracker),
and its leader may then exit 0.  :func:`log_excerpt` quotes the first traceback (or, without one, the first
error line and what follows it), as systemd and docker compose show a failed unit's error; only a log with
neither is quoted by its last lines.
"""

from __future__ import annotations

import re
from collections import deque
from pathlib import Path

TAIL_LINES = 40
_READ_LINES = 20_000  # a log's last lines searched for the error: minutes of vLLM start-up fit
_BLOCK_LINES = 30  # a traceback longer than this keeps its first line and its last frames
_TRACEBACK = "Traceback (most recent call last)"
# "RuntimeError: ...", "torch.OutOfMemoryError: ...", "KeyboardInterrupt", after vLLM's line prefix
_EXCEPTION = re.compile(r"(?:^|\s|\])(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Interrupt|Exit)\b(?::|$)")
_ERROR = re.compile(r"\bERROR\b|\bFATAL\b|[A-Z]\w*Error:")


def log_excerpt(path: Path) -> tuple[str, bool]:
    """(the part of the log at ``path`` worth quoting, whether it is an error): the first traceback through
    its exception line, else the first error line and up to 10 lines after it, else the last
    :data:`TAIL_LINES` lines.  ``("(no log)", False)`` when the file cannot be read."""
    try:
        with open(path, errors="replace") as f:
            lines = [line.rstrip("\n") for line in deque(f, maxlen=_READ_LINES)]
    except OSError:
        return "(no log)", False
    start = next((i for i, line in enumerate(lines) if _TRACEBACK in line), None)
    if start is not None:
        end = next((i for i in range(start + 1, len(lines)) if _EXCEPTION.search(_message(lines[i]))), len(lines) - 1)
        block = lines[start : end + 1]
        if len(block) > _BLOCK_LINES:
            block = [block[0], "  ...", *block[-(_BLOCK_LINES - 2) :]]
        return "\n".join(block), True
    first = next((i for i, line in enumerate(lines) if _ERROR.search(line)), None)
    if first is not None:
        return "\n".join(lines[first : first + 11]), True
    return "\n".join(lines[-TAIL_LINES:]).rstrip() or "(empty log)", False


def _message(line: str) -> str:
    """A log line without vLLM's prefix ``(EngineCore_DP0 pid=7) ERROR 12-07 10:01:00 [core.py:9]``."""
    return line.rsplit("] ", 1)[-1] if line.lstrip().startswith("(") else line
