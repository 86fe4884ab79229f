"""`kvhub serve --dry-run` for scripts and other directories (ux-3 U3-14): --json and --format tsv give the
commands as data, and a relative --db reaches the servers as an absolute path, so the printed commands
run from any directory."""

from __future__ import annotations

import json
import os
import shlex

from tests.serving.test_serve import _invoke, _serve_args, fake_vllm, mapper_db  # noqa: F401  (fixtures)


def _consumer_db(argv: list[str]) -> str:
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    return config["kv_connector_extra_config"]["db"]


def test_dry_run_json_gives_each_server_as_data(mapper_db, tmp_path, fake_vllm):  # noqa: F811
    result = _invoke(
        *_serve_args(mapper_db, tmp_path, fake_vllm, [8001, 8002], "--dry-run", "--kv-cache-gib", "2", "--json")
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert set(out["servers"]) == {"small", "large"} and out["env"] == {"VLLM_CPU_KVCACHE_SPACE": "2"}
    for server in out["servers"].values():
        assert shlex.split(server["command"]) == server["argv"] and server["argv"][1] == "serve"


def test_dry_run_tsv_is_one_line_per_server(mapper_db, tmp_path, fake_vllm):  # noqa: F811
    result = _invoke(
        *_serve_args(
            mapper_db, tmp_path, fake_vllm, [8001, 8002], "--dry-run", "--kv-cache-gib", "2", "--format", "tsv"
        )
    )
    assert result.exit_code == 0, result.output
    header, *rows = result.stdout.splitlines()
    assert header.split("\t") == ["server", "env", "command"] and [r.split("\t")[0] for r in rows] == ["small", "large"]


def test_a_relative_db_is_printed_absolute(mapper_db, tmp_path, fake_vllm, monkeypatch):  # noqa: F811
    monkeypatch.chdir(tmp_path)
    relative = os.path.relpath(mapper_db, tmp_path)
    result = _invoke(
        *_serve_args(relative, tmp_path, fake_vllm, [8001, 8002], "--dry-run", "--kv-cache-gib", "2", "--json")
    )
    assert result.exit_code == 0, result.output
    argv = json.loads(result.stdout)["servers"]["large"]["argv"]
    assert _consumer_db(argv) == os.path.abspath(mapper_db)


def test_serve_resolves_the_mapper_without_loading_its_tensors(mapper_db, tmp_path, fake_vllm, monkeypatch):  # noqa: F811
    """kvhub serve asks kvhub.api.resolve for the ref and the model ids; the large server loads the tensors.
    Planted bug caught: serve loading the whole mapper (safetensors' load_file) only to learn its ids."""
    import safetensors.torch

    def no_load(*args, **kwargs):
        raise AssertionError("kvhub serve loaded the mapper's tensors")

    monkeypatch.setattr(safetensors.torch, "load_file", no_load)
    result = _invoke(
        *_serve_args(mapper_db, tmp_path, fake_vllm, [8001, 8002], "--dry-run", "--kv-cache-gib", "2", "--json")
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["ref"].endswith("@v1")
