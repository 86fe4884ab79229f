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


@pytest.mark.hub
def test_pull_reports_the_bytes_it_downloads(hub_env, db, monkeypatch):
    """kvhub turned huggingface_hub's per-file bars off (U3-18), so it shows the download's bytes itself: the
    library reports them through its progress callback (done up to the total of the files fetched, the
    tensor file included), and `kvhub pull` off a terminal ends with a line in bytes.

    Planted bug caught: a spinner and no size for a pull of a 16 GB mapper (ux-4 U4-17)."""
    from kvhub.hub import pull
    from kvhub.store import open_store
    from tests.fixtures_hub import register, run

    v1 = register(db, hub_env.tmp / "a1", seed=1)
    assert run("push", v1.ref, "--repo", "alice/kvmap", "--db", db).exit_code == 0
    with open_store(db) as store:
        tensor_bytes = (store.artifact_path(v1) / "mapper.safetensors").stat().st_size
    seen = []
    with open_store(str(hub_env.tmp / "other.db")) as store:
        pull(store, "alice/kvmap@v1", progress=lambda *call: seen.append(call))
    assert seen and all(label.startswith("pull alice/kvmap@v1") for label, _, _ in seen)
    done, total = seen[-1][1:]
    assert done == total >= tensor_bytes and [d for _, d, _ in seen] == sorted(d for _, d, _ in seen)

    monkeypatch.setenv("KVHUB_PROGRESS_INTERVAL", "0")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_env.tmp / "hf-cache-2"))  # downloaded again, not from the cache
    result = run("pull", "alice/kvmap@v1", "--db", str(hub_env.tmp / "third.db"))
    assert result.exit_code == 0, result.output
    assert "pull alice/kvmap@v1: " in result.stderr and "KB (100%)" in result.stderr


@pytest.mark.hub
def test_push_says_how_much_it_uploads(hub_env, db, monkeypatch):
    """huggingface_hub's upload reports nothing kvhub can draw as bytes, so the push says its size: in the
    spinner on a terminal and in its closing line (ux-4 U4-17)."""
    from kvhub.cli import output, progress
    from tests.fixtures_hub import register, run

    v1 = register(db, hub_env.tmp / "a1", seed=1)
    shown = []
    real_status = progress.err_console.status
    monkeypatch.setattr(progress, "bars_wanted", lambda: True)
    monkeypatch.setattr(progress.err_console, "status", lambda text, **k: shown.append(text) or real_status(text))
    result = run("push", v1.ref, "--repo", "alice/kvmap", "--db", db)
    assert result.exit_code == 0, result.output
    size = output.format_size(v1.artifact_bytes)
    assert shown == [f"pushing {v1.ref} ({size}) to alice/kvmap"]
    assert f"pushed {v1.ref} ({size}) to alice/kvmap@v1" in result.stdout
