"""Below the break-even length the large server prefills instead of escalating (issue 34, item 3).

A consumer with ``min_escalation_tokens`` N gives a prompt of fewer than N tokens 0 matched tokens (vLLM
prefills it; the KV store is not even looked up), and the response's ``kv_transfer_params["kvhub"]`` says
``fallback: "prefill"`` and why; a prompt of N tokens or more loads as before; 0 escalates every prompt.
Driven through the connector's scheduler side, vLLM stood in where it is not installed (tests/vllm_standin.py);
``kvhub serve --min-escalation-tokens`` reaches the large server only.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvhub.errors import ConfigError
from kvhub.serving.connector_config import MIN_ESCALATION_TOKENS
from tests.fixtures_store import SRC_ID, store_fingerprint
from tests.serving.test_serve import _invoke, _serve_args, fake_vllm, mapper_db  # noqa: F401  (fixtures)
from tests.serving.test_tenant_isolation import MATCHED, PROMPT, _ask, _connector, _store_prompt
from tests.vllm_standin import request, scheduler_output, vllm_modules  # noqa: F401

LONG = [(3 * i + 1) % 90 + 1 for i in range(MIN_ESCALATION_TOKENS + 44)]  # 300 tokens: past the default


def _store(kvstore_dir, prompt: list[int]) -> None:
    from kvhub.serving.kvstore import KVStore

    src = store_fingerprint(SRC_ID)
    shape = (src["num_kv_heads"], len(prompt), src["head_dim"])
    keys = [torch.randn(*shape) for _ in range(src["num_layers"])]
    values = [torch.randn(*shape) for _ in range(src["num_layers"])]
    KVStore(kvstore_dir, max_bytes=1 << 26).put(
        isolation_key="alice", source_model=SRC_ID, token_ids=prompt, keys=keys, values=values
    )


def _events(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _default_consumer(tmp_path, **extra):
    """A consumer as tests.serving.test_tenant_isolation._connector makes one, without its min_escalation_tokens=0."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvhub.serving.vllm_connector import KVHubConnector
    from tests.fixtures_store import make_store_artifact
    from tests.vllm_standin import BlockManager, vllm_config

    make_store_artifact(tmp_path / "artifact")
    options = {"kvstore_dir": str(tmp_path / "kvstore"), "mapper_path": str(tmp_path / "artifact"), **extra}
    target = dict(store_fingerprint("Qwen/Tiny-Coder-1.5B-Instruct"))
    config = vllm_config(role="kv_consumer", extra=options, target=target)
    connector = KVHubConnector(config, KVConnectorRole.SCHEDULER)
    connector._kv_cache_manager = BlockManager()
    return connector


def test_a_prompt_below_the_default_is_prefilled_and_says_so(tmp_path, vllm_modules):
    """Known answer: the 80-token prompt is stored, yet the default consumer (256) loads nothing and reports
    a plain prefill of all 80 tokens, every one of the 79 context positions its own; the 300-token one loads."""
    assert MIN_ESCALATION_TOKENS == 256
    _store_prompt(tmp_path / "kvstore", "alice")
    _store(tmp_path / "kvstore", LONG)
    events = tmp_path / "events.jsonl"
    consumer = _default_consumer(tmp_path, events_path=str(events))
    matched, response = _ask(consumer, request("short", PROMPT, cache_salt="alice"))
    assert matched == 0
    assert response == {
        "kvhub": {
            "fallback": "prefill",
            "reason": f"prompt of 80 tokens is below min_escalation_tokens={MIN_ESCALATION_TOKENS}",
            "prompt_tokens": 80,
            "mapped_tokens": 0,
            "prefill_tokens": 80,
            "exact_tokens": 79,
            "exact_fraction": 1.0,
            "transfer_status": "fallback_reprefill",
        }
    }
    assert consumer.counters["fallback"] == 1 and consumer.counters["hit"] == 0
    (fallback,) = _events(events)
    assert fallback["event"] == "fallback" and "below min_escalation_tokens=256" in fallback["reason"]

    matched, response = _ask(consumer, request("long", LONG, cache_salt="alice"))
    expected = (len(LONG) - 16) // 16 * 16  # the exact suffix of 16, block-rounded (16-token blocks)
    assert matched == expected and response["kvhub"]["mapped_tokens"] == expected
    assert "fallback" not in response["kvhub"] and consumer.counters["hit"] == 1


@pytest.mark.parametrize(
    "threshold, loads",
    [(81, False), (80, True), (0, True), ("81", False), ("0", True)],
    ids=["one-above", "equal", "zero-disables", "digits-above", "digits-zero"],
)
def test_the_threshold_counts_prompt_tokens(tmp_path, vllm_modules, threshold, loads):
    """Fewer than N tokens fall back; N tokens escalate; 0 escalates every prompt."""
    _store_prompt(tmp_path / "kvstore", "alice")
    consumer = _connector(tmp_path, "kv_consumer", min_escalation_tokens=threshold)
    matched, response = _ask(consumer, request("r", PROMPT, cache_salt="alice"))
    if loads:
        assert matched == MATCHED and response["kvhub"]["mapped_tokens"] == MATCHED
    else:
        assert matched == 0 and response["kvhub"]["fallback"] == "prefill"
        assert response["kvhub"]["reason"] == "prompt of 80 tokens is below min_escalation_tokens=81"


def test_vllms_own_prefix_hit_is_not_prefilled_again(tmp_path, vllm_modules):
    consumer = _connector(tmp_path, "kv_consumer", min_escalation_tokens=100)
    req = request("r", PROMPT, cache_salt="alice")
    assert consumer.get_num_new_matched_tokens(req, 32) == (0, False)
    consumer.update_state_after_alloc(req, None, 0)
    report = consumer.request_finished(req, [])[1]["kvhub"]
    assert report["prefill_tokens"] == 80 - 32 and report["exact_tokens"] == 79
    assert report["transfer_status"] == "fallback_reprefill"


def test_a_refused_tenant_still_hears_nothing(tmp_path, vllm_modules):
    """The isolation checks come first: a short prompt naming its tenant the wrong way gets no report either."""
    consumer = _connector(tmp_path, "kv_consumer", min_escalation_tokens=100)
    matched, response = _ask(consumer, request("r", PROMPT, cache_salt="bob", params={"kvhub_tenant": "alice"}))
    assert matched == 0 and response is None


@pytest.mark.parametrize("value", [-1, "-1", 1.5, "1.5", True, "1e3", "256 ", "²", None, [256]], ids=repr)
def test_bad_thresholds_are_refused_at_start(tmp_path, vllm_modules, value):
    with pytest.raises(ConfigError, match="min_escalation_tokens must be a whole number, 0 or more"):
        _connector(tmp_path, "kv_consumer", min_escalation_tokens=value)


@pytest.mark.parametrize("value", [-1, 2.5, "x"], ids=repr)
def test_transfer_configs_refuse_a_bad_threshold(tmp_path, value):
    from kvhub.serving.launch import transfer_configs

    with pytest.raises(ConfigError, match="min_escalation_tokens"):
        transfer_configs(kvstore_dir=tmp_path, source_model="s", mapper="a:b:c@latest", min_escalation_tokens=value)


def _extra(argv: list[str]) -> dict:
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]


@pytest.mark.parametrize(
    "option, consumer",
    [(["--min-escalation-tokens", "512"], 512), (["--min-escalation-tokens", "0"], 0), ([], None)],
    ids=["512", "zero", "absent"],
)
def test_serve_passes_the_threshold_to_the_large_server_only(
    mapper_db,
    tmp_path,
    fake_vllm,
    option,  # noqa: F811
    consumer,
):
    result = _invoke(
        *_serve_args(
            mapper_db, tmp_path, fake_vllm, [8001, 8002], *option, "--dry-run", "--kv-cache-gib", "2", "--json"
        )
    )
    assert result.exit_code == 0, result.output
    servers = json.loads(result.stdout)["servers"]
    assert "min_escalation_tokens" not in _extra(servers["small"]["argv"])
    assert _extra(servers["large"]["argv"]).get("min_escalation_tokens") == consumer  # absent: the default, 256


@pytest.mark.parametrize("value", ["-1", "1.5", "many"])
def test_serve_refuses_a_bad_threshold(mapper_db, tmp_path, fake_vllm, value):  # noqa: F811
    result = _invoke(
        *_serve_args(mapper_db, tmp_path, fake_vllm, [8001, 8002], "--min-escalation-tokens", value, "--dry-run")
    )
    assert result.exit_code == 2 and "--min-escalation-tokens" in result.output


def test_the_benchmark_reads_the_break_even_length_off_its_curve():
    """benchmarks/vllm_ttft.py's ``pays_from``: the shortest length from which on every longer one escalating beats
    prefill.  Known answer on a planted curve: a dip at 1k moves it past the dip; a mode that never pays has none."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "vllm_ttft.py"
    spec = importlib.util.spec_from_file_location("vllm_ttft", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = {
        n: {"map_only": {"speedup": m}, "recompute": {"speedup": r}}
        for n, m, r in [(512, 1.4, 1.2), (1024, 2.0, 0.9), (2048, 3.0, 1.5), (4096, 5.0, 2.5)]
    }
    curve = bench.break_even(rows)
    assert curve["map_only"] == {"speedup": {512: 1.4, 1024: 2.0, 2048: 3.0, 4096: 5.0}, "pays_from": 512}
    assert curve["recompute"]["pays_from"] == 2048
    slow = {n: {"map_only": {"speedup": 0.5}, "recompute": {"speedup": 0.5}} for n in (512, 1024)}
    assert bench.break_even(slow)["recompute"]["pays_from"] is None


def test_a_request_may_ask_for_the_large_models_own_prefill(tmp_path, vllm_modules):
    """kvhub_prefill: true loads nothing even though the prompt is stored, and says so; false loads as usual;
    anything but a JSON boolean is refused (the request is prefilled), never read as true."""
    _store_prompt(tmp_path / "kvstore", "alice")
    consumer = _connector(tmp_path, "kv_consumer")
    matched, response = _ask(consumer, request("settle", PROMPT, cache_salt="alice", params={"kvhub_prefill": True}))
    assert matched == 0
    assert response["kvhub"]["fallback"] == "prefill" and "kvhub_prefill" in response["kvhub"]["reason"]
    assert response["kvhub"]["exact_tokens"] == len(PROMPT) - 1 and response["kvhub"]["mapped_tokens"] == 0
    matched, response = _ask(consumer, request("load", PROMPT, cache_salt="alice", params={"kvhub_prefill": False}))
    assert matched == MATCHED and response["kvhub"]["mapped_tokens"] == MATCHED
    matched, _ = _ask(consumer, request("bad", PROMPT, cache_salt="alice", params={"kvhub_prefill": "yes"}))
    assert matched == 0
    assert consumer.counters["fallback"] == 2


def test_every_block_of_a_loaded_request_leaves_the_prefix_cache(tmp_path, vllm_modules):
    """Blocks computed over mapped ones (vLLM's tail, the generated tokens) lose their hashes each step and when
    the request finishes, from the first mapped block on (vLLM's own prefix hit before it stays); a request
    that loaded nothing keeps its blocks."""
    _store_prompt(tmp_path / "kvstore", "alice")
    consumer = _connector(tmp_path, "kv_consumer")
    manager = consumer._kv_cache_manager
    loaded = request("loaded", PROMPT, cache_salt="alice")
    matched, _ = consumer.get_num_new_matched_tokens(loaded, 16)  # vLLM's own hit: the first 16-token block
    consumer.update_state_after_alloc(loaded, None, matched)
    assert manager.evicted == [{1, 2, 3}]  # the mapped blocks [16, 64), at allocation
    consumer.build_connector_meta(scheduler_output([]))
    assert manager.evicted[-1] == set(manager.blocks[4:])  # this step: every block after the mapped ones
    consumer.build_connector_meta(scheduler_output([]))
    assert manager.evicted[-1] == {manager.blocks[-1]}  # the next: only the last block, which may have filled
    consumer.request_finished(loaded, [0, 1, 2, 3, 4, 5, 6])
    assert manager.evicted[-1] == {1, 2, 3, 4, 5, 6}
    count = len(manager.evicted)
    consumer.build_connector_meta(scheduler_output([]))  # finished: no longer tracked
    own = request("own", PROMPT, cache_salt="bob")
    matched, _ = consumer.get_num_new_matched_tokens(own, 0)
    consumer.update_state_after_alloc(own, None, matched)
    consumer.request_finished(own, [0, 1, 2])
    assert matched == 0 and len(manager.evicted) == count
