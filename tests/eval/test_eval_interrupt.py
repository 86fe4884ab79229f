"""Ctrl-C during `kvhub eval` says how to go on (ux-3 U3-20), as fit does: the per-item cache keeps what
was scored, and the same command resumes there."""

from __future__ import annotations

import contextlib
import types

from click.testing import CliRunner

from kvhub.cli import eval_cmd
from kvhub.cli.main import main
from kvhub.eval import run


def test_U3_20_interrupted_eval_names_the_resume(monkeypatch):
    loaded = types.SimpleNamespace(
        version=types.SimpleNamespace(tensors_sha256="0" * 64),
        mapper=types.SimpleNamespace(deshrink="auto"),
        device="cpu",
    )
    monkeypatch.setattr(eval_cmd, "_check_before_loading", lambda *a, **k: {})
    monkeypatch.setattr(eval_cmd, "_load_version", lambda *a, **k: (contextlib.nullcontext(), loaded))
    monkeypatch.setattr(run, "RunSettings", lambda *a, **k: None)
    monkeypatch.setattr(run, "build_tasks", lambda *a, **k: [])

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "evaluate", stopped)
    result = CliRunner().invoke(main, ["eval", "a:b:c@v1", "--task", "hellaswag"])
    assert result.exit_code == 130
    assert "run the same command to resume" in result.stderr and "cached" in result.stderr
