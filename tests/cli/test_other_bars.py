"""Other libraries' progress bars and advice stay out of kvhub's output (ux-3 U3-18): huggingface_hub's
per-file bars during push and pull (kvhub shows one line of its own), transformers' GGUF conversion bar
and its dtype advice during `kvhub fetch models`."""

from __future__ import annotations

import io
import logging

import pytest

from kvhub.models.loading import quiet_loading


def test_gguf_conversion_bar_and_dtype_advice_are_silent(capsys, caplog):
    gguf_utils = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    with quiet_loading(), caplog.at_level(logging.WARNING):
        list(gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors...", file=io.StringIO()))
        bar = gguf_utils.tqdm(range(3), desc="x")
        assert bar.disable
        logging.getLogger("transformers.quantizers.quantizer_gguf").warning("Pass `dtype=torch.float32` to avoid it")
    assert "dtype=torch.float32" not in caplog.text
    assert not gguf_utils.tqdm(range(1), file=io.StringIO()).disable  # restored after


def test_push_and_pull_turn_huggingface_hubs_bars_off(monkeypatch, tmp_path):
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars

    from kvhub.cli import progress

    monkeypatch.setattr(progress, "bars_wanted", lambda: True)  # as on a terminal
    enable_progress_bars()
    seen = []
    with progress.hub_transfer("pulling acme/kvmap"):
        seen.append(are_progress_bars_disabled())
    assert seen == [True] and not are_progress_bars_disabled()


@pytest.mark.hub
def test_pull_downloads_without_their_bars(hub_env, db, monkeypatch):
    import huggingface_hub
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars

    from kvhub.cli import progress
    from tests.fixtures_hub import register, run

    v1 = register(db, hub_env.tmp / "a1", seed=1)
    assert run("push", v1.ref, "--repo", "alice/kvmap", "--db", db).exit_code == 0
    monkeypatch.setattr(progress, "bars_wanted", lambda: True)
    monkeypatch.setattr(progress, "quiet_other_bars", lambda **k: None)  # a terminal keeps them otherwise
    enable_progress_bars()
    seen = []
    real = huggingface_hub.snapshot_download

    def spy(*args, **kwargs):
        seen.append(are_progress_bars_disabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", spy)
    result = run("pull", "alice/kvmap", "--db", str(hub_env.tmp / "other.db"))
    assert result.exit_code == 0, result.output
    assert seen == [True]
