"""`kvhub serve` sizes each CPU engine's KV cache after both models' weights, also for Hub ids nobody
fetched (ux-3 U3-7): their size comes from the config, as `kvhub plan` reads it."""

from __future__ import annotations

import logging

import pytest

from kvhub.serving import launch

SMALL, LARGE = "Qwen/Qwen2.5-Coder-0.5B-Instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct"


@pytest.fixture
def nothing_fetched(tmp_path, monkeypatch):
    monkeypatch.setenv("KVHUB_CACHE", str(tmp_path / "kvhub-cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))


def test_unfetched_hub_ids_weigh_their_parameters(nothing_fetched):
    assert 0.8 < launch.weights_gib(SMALL) < 1.2  # 494M parameters in 16 bits
    assert 2.6 < launch.weights_gib(LARGE) < 3.2  # 1.54B


def test_the_pair_gets_the_kv_cache_measured_to_fit_24_gib(nothing_fetched):
    """launch.py's measurement: 3 GiB each ran a 24 GiB host out of memory, 1 GiB each fits."""
    sizes = [launch.weights_gib(m) for m in (SMALL, LARGE)]
    assert launch.cpu_kv_cache_gib(total_gib=24, weights_gib=sizes) == 1


def test_an_unknown_id_is_said(nothing_fetched, caplog):
    with caplog.at_level(logging.WARNING, logger="kvhub"):
        assert launch.weights_gib("nobody/unknown-model") == 0.0
    assert "--kv-cache-gib" in caplog.text


def test_a_local_folder_weighs_its_files(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(bytes(1 << 20))
    assert launch.weights_gib(tmp_path) == pytest.approx(1 / 1024)
