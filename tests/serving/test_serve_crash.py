"""A served engine that dies: `kvhub serve` quotes the error from its log, not the shutdown chatter that
follows it, and calls a crash a crash whatever the exit code (ux-4 U4-7)."""

from __future__ import annotations

import sys
import time

import pytest

from kvhub.errors import ServeError
from kvhub.serving import launch
from tests.fixtures_store import DST_ID, SRC_ID
from tests.serving.test_serve import _invoke, _serve_args, fake_vllm, mapper_db  # noqa: F401  (fixtures)

# What a vLLM server's log holds when its engine dies at the first request: the engine's traceback, the
# API server's consequences, then ~100 lines of shutdown messages, and a leader that exits 0.
CRASHING_SERVER = r"""
import sys
print("INFO 12-07 10:00:00 [api_server.py:1] vLLM API server version 0.32.0", flush=True)
for n in range(30):
    print(f"INFO 12-07 10:00:{n:02d} [loader.py:2] loading weights {n}", flush=True)
print("(EngineCore_DP0 pid=7) ERROR 12-07 10:01:00 [core.py:9] EngineCore encountered a fatal error.")
print("(EngineCore_DP0 pid=7) ERROR 12-07 10:01:00 [core.py:9] Traceback (most recent call last):")
for n in range(3):
    print(f'(EngineCore_DP0 pid=7) ERROR 12-07 10:01:00 [core.py:9]   File "/v/engine{n}.py", line {n}, in step')
    print(f"(EngineCore_DP0 pid=7) ERROR 12-07 10:01:00 [core.py:9]     out = self.run{n}()")
print("(EngineCore_DP0 pid=7) ERROR 12-07 10:01:00 [core.py:9] RuntimeError: Unsupported CPU attention "
      "configuration: head_dim=16 isa=2 kv_cache_idx=0")
print("(APIServer pid=5) ERROR 12-07 10:01:01 [async_llm.py:3] AsyncLLM output_handler failed.")
for n in range(100):
    print(f"(APIServer pid=5) INFO 12-07 10:01:02 [shutdown] force killing worker {n}")
print("resource_tracker: There appear to be 2 leaked shared_memory objects to clean up at shutdown")
sys.exit(0)
"""


def _dead_server(tmp_path, script: str) -> launch.ServerPair:
    server = launch.Server(
        "small", [sys.executable, "-c", script], "http://127.0.0.1:9/v1", "m", tmp_path / "small.log"
    )
    pair = launch.ServerPair([server], stop_timeout=5)
    pair.start()
    deadline = time.monotonic() + 30
    while server.process.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return pair


def test_a_crashed_engine_is_reported_with_its_error_not_the_shutdown_lines(tmp_path):
    """Planted bugs caught: the log's last lines quoted (vLLM's `[shutdown] force killing` messages, the
    error 100 lines above them); "exited with code 0" for a server whose engine raised."""
    with _dead_server(tmp_path, CRASHING_SERVER) as pair, pytest.raises(ServeError) as died:
        pair.wait(interval=0.01)
    message = str(died.value)
    assert "the small server crashed" in message and "exited with code 0" not in message
    assert "RuntimeError: Unsupported CPU attention configuration: head_dim=16" in message
    assert "Traceback (most recent call last)" in message and "force killing" not in message
    assert str(tmp_path / "small.log") in message


def test_a_server_that_exits_without_an_error_in_its_log_shows_its_last_lines(tmp_path):
    script = "print('INFO starting'); print('stopped, nothing to report'); import sys; sys.exit(3)"
    with _dead_server(tmp_path, script) as pair, pytest.raises(ServeError) as died:
        pair.wait(interval=0.01)
    message = str(died.value)
    assert "the small server exited with code 3" in message and "stopped, nothing to report" in message


@pytest.mark.parametrize("gpu", [False, True])
def test_head_sizes_vllms_cpu_attention_lacks_are_said_before_the_start(
    mapper_db,  # noqa: F811
    tmp_path,
    fake_vllm,  # noqa: F811
    monkeypatch,
    gpu,
):
    """The tiny mapper's models have head_dim 8 and 16, which vLLM's CPU attention cannot compute: said on
    stderr before the servers start, naming both models; nothing said where a GPU serves them.

    Planted bug caught: the check left to the engine, which reported ready after minutes and died at the
    first request (ux-4 U4-7)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    result = _invoke(*_serve_args(mapper_db, tmp_path, fake_vllm, [8001, 8002], "--dry-run", "--kv-cache-gib", "2"))
    assert result.exit_code == 0, result.output
    said = " ".join(result.stderr.split())
    if gpu:
        assert "CPU attention" not in said
    else:
        assert f"the small model {SRC_ID} has 8 and the large model {DST_ID} has 16" in said
        assert "fails at its first request" in said
