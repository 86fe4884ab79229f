"""Tensor (and pipeline, context) parallelism is refused at start-up, by ``kvhub serve`` before any server
starts and by the connector's constructor in either role, with an error naming the limitation
(kvhub.serving.engine_limits); one rank per engine starts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from kvhub.cli.main import main
from kvhub.errors import ConfigError
from kvhub.serving.engine_limits import check_engine, check_parallel_args
from tests.vllm_standin import vllm_modules  # noqa: F401  (fixture: vLLM, or its stand-in where none is installed)


@pytest.mark.parametrize(
    "args, kind",
    [
        (["--tensor-parallel-size", "2"], "tensor"),
        (["--max-model-len", "4096", "-tp", "4"], "tensor"),
        (["--tensor-parallel-size=8"], "tensor"),
        (["--tensor_parallel_size", "2"], "tensor"),
        (["-pp", "2"], "pipeline"),
        (["--pipeline-parallel-size=2"], "pipeline"),
        (["--decode-context-parallel-size", "2"], "decode context"),
    ],
)
def test_vllm_arguments_that_shard_the_model_are_refused(args, kind):
    with pytest.raises(
        ConfigError,
        match=f"{kind} parallel size \\d is not supported; the kvhub connector needs "
        "each engine's KV cache on one rank",
    ):
        check_parallel_args(args)


@pytest.mark.parametrize(
    "args", [[], ["--tensor-parallel-size", "1"], ["-tp=1", "--data-parallel-size", "2"], ["--max-model-len", "2"]]
)
def test_one_rank_per_engine_passes(args):
    check_parallel_args(args)


def test_a_parallel_size_that_is_not_a_number_is_refused():
    with pytest.raises(ConfigError, match="needs a whole number"):
        check_parallel_args(["--tensor-parallel-size"])


def test_kvhub_serve_refuses_tensor_parallel_before_anything_starts(tmp_path):
    """Refused before the mapper is even resolved (the store here does not exist) and before any directory
    is made or server started."""
    result = CliRunner().invoke(
        main,
        [
            "serve",
            "a:b",
            "--db",
            str(tmp_path / "none.db"),
            "--vllm",
            "/bin/true",
            "--kvstore-dir",
            str(tmp_path / "kv"),
            "--",
            "--tensor-parallel-size",
            "2",
        ],
    )
    assert result.exit_code == 2, result.output
    assert "tensor parallel size 2 is not supported" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "kv").exists() and not (tmp_path / "none.db").exists()


def _engine(**parallel):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(**{"tensor_parallel_size": 1, "pipeline_parallel_size": 1, **parallel}),
        model_config=SimpleNamespace(model="m", hf_config=SimpleNamespace(model_type="qwen2", num_hidden_layers=2)),
    )


@pytest.mark.parametrize(
    "field, kind",
    [
        ("tensor_parallel_size", "tensor"),
        ("pipeline_parallel_size", "pipeline"),
        ("decode_context_parallel_size", "decode context"),
    ],
)
def test_check_engine_refuses_a_sharded_engine(field, kind):
    with pytest.raises(ConfigError, match=f"KVHubConnector \\({field}=2\\): {kind} parallel size 2"):
        check_engine(_engine(**{field: 2}))
    check_engine(_engine())
    check_engine(_engine(data_parallel_size=2))  # replicas hold every head: not refused


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_the_connector_refuses_tensor_parallel_at_init(vllm_modules, tmp_path, role):
    from kvhub.serving.vllm_connector import KVHubConnector
    from tests.vllm_standin import KVConnectorRole, vllm_config

    config = vllm_config(role=role, extra={"kvstore_dir": str(tmp_path / "kv"), "mapper_path": str(tmp_path / "m")})
    config.parallel_config = SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1)
    for side in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError, match="tensor parallel size 2 is not supported"):
            KVHubConnector(config, side)
    assert not (tmp_path / "kv").exists()  # refused before the KV store is opened
