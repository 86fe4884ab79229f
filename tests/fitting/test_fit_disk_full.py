"""A full disk under ``kvhub fit``: the calibration cache and the checkpoints are what the fit does not need, so a
write of theirs that finds no space is a warning and the fit goes on; the artifact (``--out``) is what it does
need, so a full disk there is one line, "no space left on DIR", exit 9, with nothing half-written and nothing
registered.  The disk is made full by making those writes fail as a full one does (ENOSPC, and safetensors'
"No space left on device (os error 28)")."""

from __future__ import annotations

import errno
import os
import sqlite3

from click.testing import CliRunner

from kvhub.artifact import files
from kvhub.cli.main import main
from kvhub.errors import StoreError
from tests.fitting.test_cli_fit import _fit_args, env  # noqa: F401 - env is a fixture

NO_SPACE = "no space left on"


def _versions(db: str) -> int:
    path = db.removeprefix("sqlite:///")
    if not os.path.exists(path):
        return 0
    with sqlite3.connect(path) as connection:
        return connection.execute("SELECT count(*) FROM mapper_versions").fetchone()[0]


def test_a_full_disk_under_the_cache_and_checkpoints_is_a_warning(tiny_model_dirs, env, monkeypatch, caplog):
    """Planted bugs caught: the calibration cache's save and the statistics checkpoint raising `OSError: [Errno
    28]` (a traceback before the first forward pass, or in the middle of the fit)."""
    written = []

    def full(path, data):
        written.append(os.fspath(path))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path))

    monkeypatch.setattr(files, "atomic_write_bytes", full)
    out = env["tmp"] / "exported"
    with caplog.at_level("WARNING", logger="kvhub"):
        result = CliRunner().invoke(main, _fit_args(tiny_model_dirs, env, out) + ["--samples", "24"])
    assert result.exit_code == 0, result.output
    assert any("calibration" in path for path in written) and any("checkpoints" in path for path in written)
    assert f"{NO_SPACE} " in caplog.text and "the fit goes on without it" in caplog.text
    assert "used uncached" in caplog.text
    assert (out / "mapper.json").is_file() and _versions(env["db"]) == 1


def test_a_full_disk_under_out_is_refused_in_one_line(tiny_model_dirs, env, monkeypatch):
    """Planted bug caught: `SafetensorError: Error while serializing: I/O error: No space left on device (os error
    28)` as a traceback after the whole fit (exit 1)."""
    import safetensors.torch
    from safetensors import SafetensorError

    out = env["tmp"] / "full" / "o"
    out.parent.mkdir()
    save_file = safetensors.torch.save_file

    def full_under_out(tensors, filename, *args, **kwargs):
        if os.fspath(filename).startswith(os.fspath(out.parent)):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return save_file(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", full_under_out)
    result = CliRunner().invoke(main, _fit_args(tiny_model_dirs, env, out))
    assert result.exit_code == StoreError.exit_code, result.output
    assert "Traceback" not in result.output and f"{NO_SPACE} {out.parent}" in " ".join(result.output.split())
    assert list(out.parent.iterdir()) == [] and _versions(env["db"]) == 0
