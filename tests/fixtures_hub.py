"""Fixtures for the Hub tests: a local Hub-compatible server, the environment pointing at it, and
small mapper artifacts built from tiny transformers configs.

huggingface_hub reads HF_ENDPOINT / HF_HUB_OFFLINE / the cache and token paths when it is imported;
kvhub.hub reads the environment when it runs, and passes ``endpoint=`` and ``cache_dir=`` explicitly,
so in-process tests only need the environment plus huggingface_hub's own offline flag (which
conftest turned on before the import).  The subprocess test checks the import-time path.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from tests.hub_server import HubServer

ALICE_TOKEN = "hf_aliceTESTtoken0123456789abcdef"
BOB_TOKEN = "hf_bobTESTtoken0123456789abcdefgh"
SRC_ID = "tiny-org/tiny-qwen-small"
DST_ID = "tiny-org/tiny-qwen-large"

_GEOMETRY = {  # (layers, kv heads, head dim) -> a tiny qwen2 config
    SRC_ID: dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2),
    DST_ID: dict(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2),
}


def tiny_fingerprint(model_id: str) -> dict:
    from transformers import AutoConfig

    from kvhub.fingerprint import model_fingerprint

    config = AutoConfig.for_model("qwen2", vocab_size=64, intermediate_size=64, max_position_embeddings=128,
                                  **_GEOMETRY[model_id])
    return model_fingerprint(config, model_id=model_id, revision="0123abc")


def make_artifact(directory: Path, *, seed: int = 0, calibration: str = "legal-docs", src: str = SRC_ID,
                  dst: str = DST_ID, images: bool = False) -> Path:
    """Save a small random Mapper (k=1) as an artifact directory and return its path."""
    from kvhub.mapper import Mapper

    source, target = tiny_fingerprint(src), tiny_fingerprint(dst)
    generator = torch.Generator().manual_seed(seed)
    d_in = source["num_kv_heads"] * source["head_dim"]
    d_out = target["num_kv_heads"] * target["head_dim"]
    tensors, layers = {}, []
    for m in range(target["num_layers"]):
        sources = [min(m, source["num_layers"] - 1)]
        for kind in ("k", "v"):
            tensors[f"{kind}.{m}.weight"] = torch.randn(d_in, d_out, generator=generator)
            tensors[f"{kind}.{m}.bias"] = torch.randn(d_out, generator=generator)
        layers.append({"target": m, "sources": sources, "k": 1, "lambda_k": 0.1, "lambda_v": 0.1,
                       "r2_k": 0.9 - 0.01 * m, "r2_v": 0.8 - 0.01 * m})
    metadata = {
        "source": source, "target": target, "k": 1, "lambda": 0.1, "layers": layers, "kind": "ridge",
        "calibration": {"name": calibration, "version": "1", "content_hash": "c0ffee" * 10 + "abcd", "tokens": 4096},
        "metrics": {"heldout_r2_k_mean": 0.89, "heldout_r2_v_mean": 0.79, "seed": seed},
        "created": "2025-01-01T00:00:00Z",
    }
    path = Mapper(tensors, metadata).save(directory)
    if images:
        (path / "heatmap.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(64)))
    return path


@pytest.fixture
def hub_server(tmp_path):
    """A running Hub-compatible server; users alice and bob (tokens ALICE_TOKEN, BOB_TOKEN)."""
    server = HubServer(tmp_path / "hub-server", tokens={ALICE_TOKEN: "alice", BOB_TOKEN: "bob"}).start()
    yield server
    server.stop()


@pytest.fixture
def hub_env(hub_server, tmp_path, monkeypatch):
    """Online against ``hub_server``, alice logged in through HF_TOKEN, a fresh HF cache and kvhub store."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_ENDPOINT", hub_server.endpoint)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf-home" / "token"))  # no real login
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "hf-home" / "stored_tokens"))
    monkeypatch.setenv("HF_TOKEN", ALICE_TOKEN)
    monkeypatch.delenv("HF_OIDC_RESOURCE", raising=False)
    monkeypatch.delenv("KVHUB_HUB_NAMESPACES", raising=False)
    monkeypatch.setenv("KVHUB_HOME", str(tmp_path / "kvhub-home"))
    monkeypatch.delenv("KVHUB_DB_URL", raising=False)
    return types.SimpleNamespace(server=hub_server, endpoint=hub_server.endpoint, tmp=tmp_path,
                                 cache=tmp_path / "hf-cache")


@pytest.fixture
def go_offline(monkeypatch):
    """Call to switch the rest of the test to HF_HUB_OFFLINE=1 (env and huggingface_hub's flag)."""
    from huggingface_hub import constants

    def offline() -> None:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    return offline


@pytest.fixture
def no_backoff_sleep(monkeypatch):
    """huggingface_hub retries 5xx and dropped connections with 1-8 s sleeps; make them instant."""
    import time

    from huggingface_hub.utils import _http

    fake_time = types.SimpleNamespace(**{name: getattr(time, name) for name in dir(time) if not name.startswith("_")})
    fake_time.sleep = lambda seconds: None
    monkeypatch.setattr(_http, "time", fake_time)
