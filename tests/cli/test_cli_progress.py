"""One progress system: plain periodic lines off a terminal (or with HF_HUB_DISABLE_PROGRESS_BARS), other
libraries' bars quieted; and kvhub fit refusing bad arguments before any model loads."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from kvhub.cli import progress
from kvhub.cli.main import main
from kvhub.errors import ConfigError, FitError, UnknownCalibrationError
from tests.fixtures_calib import config_only_model


def test_plain_lines_are_periodic_and_say_how_far(monkeypatch):
    now, lines = [0.0], []
    line_progress = progress.LineProgress("tok/s", interval=30, clock=lambda: now[0], write=lines.append)
    for second, done in ((0, 0), (10, 100), (29, 200), (31, 300), (45, 350), (60, 1200), (61, 1200)):
        now[0] = float(second)
        line_progress("capture: batch", done, 1200)
    line_progress("solve", 1, None)
    assert lines == [
        "capture: batch: 0/1,200 (0%), 0:00 elapsed",
        "capture: batch: 300/1,200 (25%), 10 tok/s, 0:31 elapsed, eta 1:33",
        "capture: batch: 1,200/1,200 (100%), 20 tok/s, 1:00 elapsed",  # completion is always shown, once
        "solve: 1/?, 0:00 elapsed",
    ]


def test_bars_only_on_a_terminal_and_unless_disabled(monkeypatch):
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    monkeypatch.setattr(progress.err_console, "_force_terminal", True)
    with progress.progress_callback() as callback:
        assert not isinstance(callback, progress.LineProgress)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    with progress.progress_callback() as callback:
        assert isinstance(callback, progress.LineProgress)

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS")
    monkeypatch.setattr(progress.err_console, "_force_terminal", False)  # a CI log
    try:
        with progress.progress_callback() as callback:
            assert isinstance(callback, progress.LineProgress)
        assert are_progress_bars_disabled()  # huggingface_hub's download bars too
    finally:
        enable_progress_bars()


@pytest.fixture
def no_model_loads(monkeypatch, tmp_path):
    """A source model directory with only a config (2 layers); loading any model fails the test."""
    monkeypatch.setenv("KVHUB_HOME", str(tmp_path / "home"))
    return config_only_model(tmp_path / "src", monkeypatch)


def test_fit_checks_arguments_before_loading_models(no_model_loads, tmp_path):
    runner = CliRunner()
    base = ["fit", "--src", str(no_model_loads), "--dst", str(no_model_loads), "--ignore-plan"]
    misspelt = runner.invoke(main, [*base, "--calib", "legal-doc"])
    assert misspelt.exit_code == UnknownCalibrationError.exit_code
    assert "did you mean 'legal-docs'?" in misspelt.stderr
    too_deep = runner.invoke(main, [*base, "--k", "9"])
    assert too_deep.exit_code == ConfigError.exit_code and "--k 1..2 or --k auto" in too_deep.stderr
    too_wide = runner.invoke(main, [*base, "--k", "2", "--samples", "1", "--seq-len", "16", "--stride", "4"])
    assert too_wide.exit_code == FitError.exit_code and "training observations" in too_wide.stderr
    missing = runner.invoke(main, [*base, "--calib", str(tmp_path / "notes.jsonl")])
    assert missing.exit_code == ConfigError.exit_code and "does not exist" in missing.stderr


def test_bars_show_a_rate_and_an_eta_from_the_first_slow_step():
    """A terminal bar whose updates come minutes apart (the demo's capture: one per 3-9 min batch) shows a
    rate and an eta after its first update, computed as the plain lines do: from the step's elapsed time
    and its first count (a resumed fit's checkpointed tokens are not this run's work).  Below one unit a
    second the rate reads as seconds per unit.

    Planted bugs caught: Rich's 30-second speed window (ux-4 U4-2: `eta -:--:--` and no rate for 87
    minutes); the checkpointed base counted as done now (a resumed fit's eta far too short); rates below
    1/s printed as `0 items/s` (U4-15)."""
    import io

    from rich.console import Console
    from rich.progress import Progress as RichProgress

    now = [0.0]
    bar = RichProgress(
        *progress.bar_columns("tok/s"), console=Console(file=io.StringIO()), get_time=lambda: now[0], auto_refresh=False
    )
    callback = progress.bar_callback(bar, "tok/s")
    callback("capture: train batch 1/20", 8192, 40960)  # resumed at 8,192 checkpointed tokens
    rate_column, eta_column = bar.columns[3], bar.columns[6]
    task = bar.tasks[0]
    assert str(rate_column.render(task)) == "" and str(eta_column.render(task)) == "-:--:--"
    now[0] = 400.0  # the first batch of this run: 2,048 tokens in 400 s
    callback("capture: train batch 2/20", 8192 + 2048, 40960)
    assert str(rate_column.render(task)) == "5 tok/s"
    assert str(eta_column.render(task)) == "1:40:00"  # 30,720 tokens left at 5.12 tok/s = 6,000 s
    items = progress.bar_callback(bar, "items/s")
    items("hellaswag", 0, 20)
    now[0] = 434.0
    items("hellaswag", 10, 20)  # 10 items in 34 s
    assert str(rate_column.render(bar.tasks[1])) == "3.4 s/item"
    assert progress.rate_text(0.34, "items/s") == "2.9 s/item" and progress.rate_text(3100, "tok") == "3,100 tok/s"
