"""Fixtures for the store tests: tiny mapper artifacts, and databases on SQLite and PostgreSQL.

``db_url`` is parametrized over both backends.  PostgreSQL is a throwaway cluster (initdb + pg_ctl on
a free port, trust auth, fsync off, socket in a temp dir) started once per session; each test gets
its own database in it.  Without server binaries those tests skip (``apt-get install postgresql``).
Tests run as root here, and PostgreSQL refuses to run as root: the cluster then runs as ``postgres``.
"""

from __future__ import annotations

import functools
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

SRC_ID = "Qwen/Tiny-Coder-0.5B-Instruct"
DST_ID = "Qwen/Tiny-Coder-1.5B-Instruct"
_GEOMETRY = {  # model id -> tiny qwen2 config (layers, hidden, heads, kv heads)
    SRC_ID: dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2),
    DST_ID: dict(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2),
}


@functools.lru_cache(maxsize=None)
def store_fingerprint(model_id: str, geometry_of: str | None = None) -> dict:
    """Fingerprint of a tiny Qwen2 config; ``geometry_of`` borrows another id's geometry."""
    from transformers import Qwen2Config

    from kvhub.core.fingerprint import model_fingerprint

    config = Qwen2Config(intermediate_size=64, vocab_size=100, **_GEOMETRY[geometry_of or model_id])
    return model_fingerprint(config, model_id=model_id, revision="0123abc")


def make_store_artifact(
    directory,
    *,
    seed: int = 0,
    source: str = SRC_ID,
    target: str = DST_ID,
    calibration: str = "legal-docs",
    metrics: dict | None = None,
    padding_mb: int = 0,
) -> Path:
    """Save a small random Mapper (k=1, every source layer feeding target layer m % 2) and return its dir.

    ``seed`` changes the weights (and so the content address); ``padding_mb`` adds an extra file
    (``padding.bin``: the store keeps it, push never publishes it) big enough to kill a writer mid-copy.
    """
    import torch

    from kvhub.core.mapper import Mapper

    src = store_fingerprint(source, SRC_ID if source not in _GEOMETRY else None)
    dst = store_fingerprint(target, DST_ID if target not in _GEOMETRY else None)
    generator = torch.Generator().manual_seed(seed)
    d_in, d_out = src["num_kv_heads"] * src["head_dim"], dst["num_kv_heads"] * dst["head_dim"]
    tensors, layers = {}, []
    for m in range(dst["num_layers"]):
        for kind in ("k", "v"):
            tensors[f"{kind}.{m}.weight"] = torch.randn(d_in, d_out, generator=generator)
            tensors[f"{kind}.{m}.bias"] = torch.zeros(d_out)
        layers.append(
            {
                "target": m,
                "sources": [m % src["num_layers"]],
                "lambda_k": 0.1,
                "lambda_v": 0.1,
                "r2_k": 0.9 - 0.01 * m,
                "r2_v": 0.8 - 0.01 * m,
            }
        )
    metadata = {
        "source": src,
        "target": dst,
        "layers": layers,
        "k": 1,
        "lambda": 0.1,
        "calibration": {"name": calibration, "version": 1, "content_hash": f"{calibration}-hash", "tokens": 4096},
        "metrics": metrics if metrics is not None else {"heldout_r2_k_mean": 0.89, "heldout_r2_v_mean": 0.79},
    }
    path = Mapper(tensors, metadata).save(Path(directory))
    if padding_mb:
        (path / "padding.bin").write_bytes(bytes(padding_mb << 20))
    return path


def mlp_artifact(directory: Path, *, seed: int = 0, width: int = 4, depth: int = 2) -> Path:
    """A small random mapper of kind mlp (make_store_artifact's maps plus residual MLPs), its ``mlp`` block as
    ``kvhub fit --map mlp`` writes it (schedule, rows per split, losses per layer)."""
    import torch

    from kvhub.artifact import map_prefix, tensor_name
    from kvhub.artifact.kinds import mlp_part
    from kvhub.core.mapper import Mapper

    base = Mapper.load(make_store_artifact(directory.parent / f"{directory.name}-base", seed=seed))
    generator = torch.Generator().manual_seed(seed)
    tensors = dict(base.tensors)
    d_in, d_out = tensors["k.0.weight"].shape
    widths = [d_in] + [width] * depth + [d_out]
    for layer in base.layers:
        for kind in "kv":
            prefix = map_prefix(kind, layer["target"])
            for i in range(depth + 1):
                tensors[tensor_name(prefix, mlp_part(i, "weight"))] = torch.randn(
                    widths[i], widths[i + 1], generator=generator
                )
                tensors[tensor_name(prefix, mlp_part(i, "bias"))] = torch.zeros(widths[i + 1])
    count = len(base.layers)
    losses = {kind: {"train": [0.5] * count, "heldout": [0.75] * count} for kind in "kv"}
    settings = {"width": width, "depth": depth, "activation": "gelu", "epochs": 100, "patience": 10, "lr": 1e-3}
    settings.update(batch_size=256, seed=0, tokens={"train": 512, "heldout": 128}, losses=losses)
    return Mapper(tensors, {**base.metadata, "kind": "mlp", "mlp": settings}).save(directory)


@pytest.fixture
def artifact_factory(tmp_path):
    """``artifact_factory(seed=..., ...)`` -> a fresh artifact directory under tmp_path."""
    counter = iter(range(10**6))

    def factory(**kwargs) -> Path:
        return make_store_artifact(tmp_path / "artifacts-in" / f"a{next(counter)}", **kwargs)

    return factory


# ---- PostgreSQL --------------------------------------------------------------------------------------
def postgres_bin_dir() -> Path | None:
    """Directory holding initdb and pg_ctl, or None."""
    found = shutil.which("initdb")
    candidates = ([Path(found).resolve().parent] if found else []) + [
        Path(p) for p in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    ]
    return next((c for c in candidates if (c / "initdb").exists() and (c / "pg_ctl").exists()), None)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PostgresCluster:
    """A throwaway PostgreSQL cluster; :meth:`new_database` hands out empty databases."""

    def __init__(self, bin_dir: Path, root: Path):
        self.bin_dir, self.root, self.port = bin_dir, root, _free_port()
        self.user = "postgres" if os.geteuid() == 0 else None

    def _run(self, *args: str) -> None:
        command = [str(self.bin_dir / args[0]), *args[1:]]
        if self.user:
            command = ["runuser", "-u", self.user, "--", *command]
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=60)

    def start(self) -> None:
        if self.user:
            shutil.chown(self.root, user=self.user)
        self._run("initdb", "-D", str(self.root / "data"), "-A", "trust", "-U", "postgres", "--no-sync")
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        self._run("pg_ctl", "-D", str(self.root / "data"), "-o", options, "-l", str(self.root / "log"), "-w", "start")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.root / "data"), "-m", "immediate", "-w", "stop")

    def _execute(self, statement: str) -> None:
        import psycopg

        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres", autocommit=True) as conn:
            conn.execute(statement)

    def new_database(self) -> str:
        """URL of a new, empty store database: its own schema, chosen by the URL's search_path.

        A schema per test instead of a database per test: CREATE DATABASE copies ~1000 files
        (0.4 s each, and deleting the cluster took 40 s on this disk); a schema costs nothing.
        """
        schema = f"t_{uuid.uuid4().hex[:12]}"
        self._execute(f"CREATE SCHEMA {schema}")
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres?options=-csearch_path%3D{schema}"


@pytest.fixture(scope="session")
def postgres_cluster():
    """A running PostgreSQL cluster for the session; skips without server binaries."""
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        pytest.skip("PostgreSQL server binaries not found; enable these tests with `apt-get install postgresql`")
    root = Path(tempfile.mkdtemp(prefix="kvhub-pg-"))
    cluster = PostgresCluster(bin_dir, root)
    try:
        cluster.start()
    except subprocess.CalledProcessError as exc:
        shutil.rmtree(root, ignore_errors=True)
        pytest.fail(f"could not start PostgreSQL: {exc.stderr or exc.stdout}")
    yield cluster
    cluster.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request, tmp_path):
    """URL of a new, empty store database, on each backend."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store' / 'kvhub.db'}"
    return request.getfixturevalue("postgres_cluster").new_database()


@pytest.fixture
def store(db_url, tmp_path):
    """An open Store on ``db_url`` with its artifacts under tmp_path."""
    from kvhub.store import open_store

    with open_store(db_url, artifacts_dir=tmp_path / "store-artifacts") as opened:
        yield opened


def load_with_old_kvhub(commit: str, artifact: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """``Mapper.load(artifact)`` run by kvhub as it was at ``commit`` (``git archive`` of that commit's package
    under ``tmp_path / "old"``), in a fresh interpreter; skips the test where that history is missing."""
    import sys

    root = Path(__file__).resolve().parents[1]
    if (
        shutil.which("git") is None
        or subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=root, capture_output=True).returncode
        != 0
    ):
        pytest.skip(f"needs the git history with commit {commit}")
    old = tmp_path / "old"
    old.mkdir()
    archive = subprocess.run(
        ["git", "archive", commit, "kvhub", "registry"], cwd=root, capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
    code = "import sys; from kvhub.core.mapper import Mapper; Mapper.load(sys.argv[1])"
    return subprocess.run(
        [sys.executable, "-c", code, str(artifact)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={"PYTHONPATH": str(old), "PATH": "/usr/bin:/bin"},
    )
