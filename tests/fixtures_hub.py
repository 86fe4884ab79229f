"""Fixtures for the Hub tests: a local Hub-compatible server, the environment pointing at it, and
small mapper artifacts (tests.fixtures_store's factory).

huggingface_hub reads HF_ENDPOINT / HF_HUB_OFFLINE / the cache and token paths when it is imported;
kvhub.hub reads the environment when it runs, and passes ``endpoint=`` and ``cache_dir=`` explicitly,
so in-process tests only need the environment plus huggingface_hub's own offline flag (which
conftest turned on before the import).  The subprocess test checks the import-time path.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from tests.fixtures_store import DST_ID, SRC_ID, make_store_artifact
from tests.hub_server import HubServer

ALICE_TOKEN = "hf_aliceTESTtoken0123456789abcdef"
BOB_TOKEN = "hf_bobTESTtoken0123456789abcdefgh"


def make_artifact(
    directory: Path,
    *,
    seed: int = 0,
    calibration: str = "legal-docs",
    src: str = SRC_ID,
    dst: str = DST_ID,
    images: bool = False,
) -> Path:
    """The store tests' small random mapper (k=1) as an artifact directory, plus a PNG when ``images``."""
    path = make_store_artifact(directory, seed=seed, source=src, target=dst, calibration=calibration)
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
    return types.SimpleNamespace(
        server=hub_server, endpoint=hub_server.endpoint, tmp=tmp_path, cache=tmp_path / "hf-cache"
    )


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


# ---- shared by the hub test modules ------------------------------------------------------------------
def run(*args: str):
    """Invoke the kvhub CLI in-process; returns click's Result (stdout, stderr, exit_code)."""
    from click.testing import CliRunner

    from kvhub.cli.main import main

    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.fixture
def db(hub_env):
    return str(hub_env.tmp / "store.db")


def register(db: str, directory, **kwargs):
    from kvhub.store import open_store

    with open_store(db) as store:
        return store.register(make_artifact(directory, **kwargs))


def push_two_versions(hub_env, db: str, repo_id: str = "alice/kvmap"):
    """Register v1 and v2 (seeds 1 and 2) of one series in ``db`` and push both to ``repo_id`` (tags v1, v2)."""
    versions = [register(db, hub_env.tmp / f"a{seed}", seed=seed) for seed in (1, 2)]
    for version in versions:
        pushed = run("push", version.ref, "--repo", repo_id, "--db", db)
        assert pushed.exit_code == 0, pushed.stderr
    return versions
