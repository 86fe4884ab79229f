"""Values read strictly, never by truthiness or truncation (reliability-3 R3-7, R3-9): the connector's
recompute keys, a request's ``kvhub_control``, and the forced-token ids of ``vllm_xargs``.  vLLM's classes
stood in for where vLLM is not installed (tests/vllm_standin.py)."""

from __future__ import annotations

import pytest

from kvhub.errors import ConfigError
from kvhub.serving.spec import Recompute
from tests.serving.test_tenant_isolation import MATCHED, PROMPT, _ask, _connector, _store_prompt
from tests.vllm_standin import SamplingParams, request, vllm_config, vllm_modules  # noqa: F401


@pytest.mark.parametrize(
    "key, value",
    [
        pytest.param("queries", 2.7, id="queries-float"),
        pytest.param("queries", True, id="queries-bool"),
        pytest.param("exact_prefix", True, id="exact-prefix-bool"),
        pytest.param("exact_suffix", "1.5", id="exact-suffix-text-float"),
        pytest.param("exact_budget", True, id="exact-budget-bool"),
        pytest.param("exact_budget", "nan", id="exact-budget-nan"),
        pytest.param("max_span", [4], id="max-span-list"),
    ],
)
def test_config_numbers_are_not_truncated(key, value):
    with pytest.raises(ConfigError, match=key):
        Recompute.from_options({key: value}, origin="kv_connector_extra_config")


@pytest.mark.parametrize(
    "key, value, read",
    [
        ("queries", "3", 3),
        ("queries", 4, 4),
        ("exact_budget", "0.2", 0.2),
        ("exact_budget", 1, 1.0),
        ("exact_prefix", 0, 0),
    ],
)
def test_numbers_as_text_or_json_still_read(key, value, read):
    assert getattr(Recompute.from_options({key: value}), key) == read


@pytest.mark.parametrize(
    "control",
    ["false", "0", "true", 0, 1, {"a": 1}, [True]],
    ids=[
        "control-text-false",
        "control-text-0",
        "control-text-true",
        "control-0",
        "control-1",
        "control-dict",
        "control-list",
    ],
)
def test_kvhub_control_must_be_a_json_boolean(tmp_path, vllm_modules, control):
    """A client's "false" used to select the control map; now anything but true/false is refused."""
    _store_prompt(tmp_path / "kvstore", "alice")
    consumer = _connector(tmp_path, "kv_consumer")
    matched, response = _ask(consumer, request("r", PROMPT, cache_salt="alice", params={"kvhub_control": control}))
    assert matched == 0 and response is None and consumer.counters["fallback"] == 1


@pytest.mark.parametrize("control", [True, False])
def test_kvhub_control_booleans_are_read(tmp_path, vllm_modules, control):
    _store_prompt(tmp_path / "kvstore", "alice")
    consumer = _connector(tmp_path, "kv_consumer")
    matched, response = _ask(consumer, request("r", PROMPT, cache_salt="alice", params={"kvhub_control": control}))
    assert matched == MATCHED and response["kvhub"]["control"] is control


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param({"kvhub_force": [2**70]}, id="id-above-int64"),
        pytest.param({"kvhub_force": [2**31]}, id="id-above-32-bits"),
        pytest.param(["kvhub_force"], id="extra-args-list"),
        pytest.param("kvhub_force", id="extra-args-string"),
    ],
)
def test_forced_ids_a_model_cannot_produce_are_a_400(vllm_modules, extra):
    from kvhub.serving.forced import ForcedTokens

    with pytest.raises(ValueError, match="vllm_xargs"):  # vLLM answers HTTP 400, not 500
        ForcedTokens.validate_params(SamplingParams(extra_args=extra))


def test_ids_beyond_the_vocabulary_are_not_silently_forced(vllm_modules, caplog):
    from kvhub.serving.forced import ForcedTokens

    config = vllm_config(role="kv_consumer", extra={})
    config.model_config.get_vocab_size = lambda: 100
    processor = ForcedTokens(config, "cpu", False)
    assert processor.new_req_logits_processor(SamplingParams(extra_args={"kvhub_force": [5, 100]})) is None
    assert "beyond this model's vocabulary of 100" in caplog.text
    assert processor.new_req_logits_processor(SamplingParams(extra_args={"kvhub_force": [5, 99]})) is not None
    assert processor.new_req_logits_processor(SamplingParams(extra_args=None)) is None


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["put-nan", "put-inf"])
def test_the_kv_store_does_not_store_non_finite_kv(tmp_path, bad):
    import torch

    from kvhub.errors import IncompatibleError
    from kvhub.serving.kvstore import KVStore

    keys = [torch.zeros(2, 16, 4) for _ in range(2)]
    values = [torch.zeros(2, 16, 4) for _ in range(2)]
    values[1][0, 3, 2] = bad
    store = KVStore(tmp_path, max_bytes=1 << 20)
    with pytest.raises(IncompatibleError, match="Inf/NaN"):
        store.put(isolation_key="a", source_model="s", token_ids=list(range(16)), keys=keys, values=values)
    assert store.longest_prefix(isolation_key="a", source_model="s", token_ids=list(range(16))) is None
