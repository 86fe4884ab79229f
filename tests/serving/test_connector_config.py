"""The connector's configuration refuses bad values at engine start (ConfigError naming the key), instead
of a raw exception inside vLLM's scheduler or a silent misreading (reliability-2 R4, R11)."""

from __future__ import annotations

import pytest

from kvhub.errors import ConfigError
from kvhub.serving import connector_config as connector
from kvhub.serving.spec import Recompute
from tests.vllm_standin import vllm_modules  # noqa: F401 - a fixture


@pytest.mark.parametrize("value, expected", [(16, 16), ("16", 16)], ids=["number", "digits"])
def test_counts_read(value, expected):
    assert connector.config_count({"chunk_tokens": value}, "chunk_tokens") == expected


@pytest.mark.parametrize("value", ["1GiB", "sixteen", 0, -5, True, 1.5, None], ids=str)
def test_bad_counts_are_refused_by_name(value):
    with pytest.raises(ConfigError, match="kvstore_max_bytes must be a positive whole number"):
        connector.config_count({"kvstore_max_bytes": value}, "kvstore_max_bytes")


@pytest.mark.parametrize(
    "old, new", [("store_dir", "kvstore_dir"), ("store_max_bytes", "kvstore_max_bytes"), ("exact_tail", "exact_suffix")]
)
def test_an_old_key_is_refused_with_its_new_name(old, new):
    """A config written before a rename gets one line naming the new key, not "unknown keys [...]" or a
    silently ignored size cap (the serving KV store's keys were store_dir and store_max_bytes)."""
    from kvhub.serving.launch import EXTRA_DEFAULTS, check_extra_keys

    with pytest.raises(ConfigError, match=f"key '{old}' is now '{new}'.*rename it"):
        check_extra_keys({**EXTRA_DEFAULTS, "kvstore_dir": "/tmp/kv", old: 1})  # as the connector merges them


@pytest.mark.parametrize("value, expected", [(True, True), (False, False), ("false", False), ("True", True)], ids=str)
def test_flags_read(value, expected):
    assert connector.config_flag({"require_isolation_key": value}, "require_isolation_key") is expected


@pytest.mark.parametrize("value", ["no", 1, None], ids=str)
def test_bad_flags_are_refused(value):
    with pytest.raises(ConfigError, match="require_isolation_key must be true or false"):
        connector.config_flag({"require_isolation_key": value}, "require_isolation_key")


def test_events_path_is_checked_at_start(tmp_path):
    assert connector.events_file(str(tmp_path / "e.jsonl")) == str(tmp_path / "e.jsonl")
    for bad in (tmp_path / "missing" / "e.jsonl", tmp_path):
        with pytest.raises(ConfigError, match="events_path"):
            connector.events_file(str(bad))


def test_only_selectors_the_consumer_can_run_are_accepted():
    for select in ("target", "source", "random"):  # source: the small model's attention the producer stored
        connector.check_serving_spec(Recompute(exact_budget=0.1, select=select), origin="x")
    connector.check_serving_spec(Recompute(exact_budget=0.0, select="deviation"), origin="x")  # nothing selected
    with pytest.raises(ConfigError, match="select='deviation'"):
        connector.check_serving_spec(Recompute(exact_budget=0.1, select="deviation"), origin="x")


def test_a_request_may_carry_its_own_spec_over_the_engines():
    base = Recompute(exact_prefix=4, exact_suffix=16, exact_budget=0.08, select="target")
    assert connector.request_spec({}, base=base) is base
    own = connector.request_spec({"kvhub_recompute": "exact_budget=0.2,select=random"}, base=base)
    assert own == Recompute(exact_prefix=4, exact_suffix=16, exact_budget=0.2, select="random")
    for bad in ({"kvhub_recompute": 3}, {"kvhub_recompute": "select=deviation"}, {"kvhub_recompute": "depth=3"}):
        with pytest.raises(ConfigError):
            connector.request_spec(bad, base=base)


@pytest.mark.parametrize("value", ["kv", "v", "off", None], ids=str)
def test_deshrink_read(value):
    assert connector.config_deshrink({} if value is None else {"deshrink": value}) == value


@pytest.mark.parametrize("value", ["KV", "on", True, 1], ids=str)
def test_a_bad_deshrink_is_refused_by_name(value):
    with pytest.raises(ConfigError, match="kv_connector_extra_config deshrink=.*: use one of kv, v, off"):
        connector.config_deshrink({"deshrink": value})


def test_the_mapper_is_loaded_with_the_configured_deshrink(tmp_path):
    import torch

    from kvhub.core.mapper import Mapper
    from tests.fixtures_store import make_store_artifact

    meanless = make_store_artifact(tmp_path / "old")  # no target_mean tensors: maps as fitted by default
    plain = Mapper.load(meanless)
    means = {
        name.replace(".bias", ".target_mean"): torch.ones_like(t)
        for name, t in plain.tensors.items()
        if name.endswith(".bias")
    }
    with_means = Mapper({**plain.tensors, **means}, plain.metadata).save(tmp_path / "new")

    def config(**keys):
        return connector.read_config({"kvstore_dir": str(tmp_path / "kv"), **keys})

    assert connector.load_mapper(config(mapper_path=str(with_means)), device="cpu").deshrink == "kv"
    assert connector.load_mapper(config(mapper_path=str(with_means), deshrink="off"), device="cpu").deshrink == "off"
    assert connector.load_mapper(config(mapper_path=str(meanless)), device="cpu").deshrink == "off"
    with pytest.raises(ConfigError, match="target_mean"):
        connector.load_mapper(config(mapper_path=str(meanless), deshrink="kv"), device="cpu")


def test_the_configuration_keys_are_declared_once_and_documented():
    """EXTRA_CONFIG is the one declaration: the accepted keys, the defaults, the renamed keys and
    docs/serving.md's table derive from it.  Planted bugs caught: a key read by the connector but not
    declared (refused as unknown at start); a recompute field of the spec missing from the table; a
    default that differs from the engine spec's; the doc's table edited by hand or left stale."""
    from pathlib import Path

    from kvhub.serving import launch
    import dataclasses

    from kvhub.serving.connector_config import (
        EXTRA_CONFIG,
        ConnectorConfig,
        EXTRA_DEFAULTS,
        EXTRA_KEYS,
        RENAMED_KEYS,
        config_table,
        read_config,
    )
    from kvhub.serving.spec import FIELDS, SERVING

    names = [key.name for key in EXTRA_CONFIG]
    assert len(names) == len(set(names)) and set(FIELDS) <= set(names)
    assert (launch.EXTRA_KEYS, launch.EXTRA_DEFAULTS, launch.RENAMED_KEYS) == (EXTRA_KEYS, EXTRA_DEFAULTS, RENAMED_KEYS)
    assert {name: EXTRA_DEFAULTS[name] for name in FIELDS} == SERVING.options()
    assert set(RENAMED_KEYS) == {"exact_tail", "store_dir", "store_max_bytes"}
    config = read_config({"kvstore_dir": "/tmp/kv", "chunk_tokens": "32", "require_isolation_key": "true"})
    assert config.chunk_tokens == 32 and config.require_isolation_key is True
    assert config.recompute == SERVING and config.isolation_key_source == "cache_salt"
    # ConnectorConfig has one field per key (the recompute keys as one), so no key is read but not declared
    typed = {f.name for f in dataclasses.fields(ConnectorConfig)}
    assert typed == {name for name in names if name not in FIELDS} | {"recompute"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.chunk_tokens = 8  # type: ignore[misc]
    with pytest.warns(DeprecationWarning, match=r"read_config\(\.\.\.\)\.chunk_tokens"):
        assert config["chunk_tokens"] == 32  # the dict it was: still read, saying what replaced it
    doc = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    assert config_table() in doc, "docs/serving.md's key table is out of step; it is:\n" + config_table()


@pytest.mark.parametrize(
    "key", ["mapper", "hub_repo", "db", "mapper_path", "kvstore_dir", "source_model", "events_path"]
)
@pytest.mark.parametrize("value", [5, True, ["a"], {"a": 1}], ids=["int", "bool", "list", "object"])
def test_a_text_key_of_another_type_is_refused_by_name(key, value):
    """Planted bug caught: `mapper: 5` / `hub_repo: 5` disabling the consumer with "AttributeError: 'int' object
    has no attribute 'strip'", naming no key."""
    with pytest.raises(ConfigError, match=f"kv_connector_extra_config {key} must be a string"):
        connector.read_config({"kvstore_dir": "/tmp/kv", key: value})


def test_text_keys_read_as_text(tmp_path):
    config = connector.read_config({"kvstore_dir": tmp_path, "mapper": "a:b:c@v1", "events_path": ""})
    assert config.kvstore_dir == str(tmp_path) and config.mapper == "a:b:c@v1"


def test_an_events_path_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    """Planted bug caught: `events_path` naming a FIFO blocked the connector's construction (open for append
    waits for a reader: still blocked after 10 s)."""
    import os
    import threading

    fifo = tmp_path / "events.fifo"
    os.mkfifo(fifo)
    outcome: list = []

    def check():
        try:
            connector.events_file(str(fifo))
            outcome.append("accepted")
        except ConfigError as exc:
            outcome.append(str(exc))

    thread = threading.Thread(target=check, daemon=True)
    thread.start()
    thread.join(timeout=5)
    assert outcome and "is not a regular file" in outcome[0], outcome or "blocked"


@pytest.mark.parametrize("chunk, refused", [(1_000_000_000, True), (257, True), (256, False), (16, False)])
def test_chunk_tokens_above_the_engines_max_model_len_is_refused(chunk, refused):
    """Planted bug caught: `chunk_tokens: 1000000000` accepted, after which the producer never stored a prompt
    (each shorter than one chunk) and recorded no event."""
    if refused:
        with pytest.raises(ConfigError, match=f"chunk_tokens {chunk} is more than the engine's max_model_len 256"):
            connector.check_chunk_tokens(chunk, max_model_len=256)
    else:
        connector.check_chunk_tokens(chunk, max_model_len=256)
    connector.check_chunk_tokens(chunk, max_model_len=None)  # an engine that does not say: nothing to check


def test_the_connector_checks_chunk_tokens_at_start(tmp_path, vllm_modules):  # noqa: F811
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvhub.serving.vllm_connector import KVHubConnector
    from tests.serving.test_tenant_isolation import _connector
    from tests.vllm_standin import vllm_config

    config = vllm_config(role="kv_producer", extra={"kvstore_dir": str(tmp_path / "kv"), "chunk_tokens": 512})
    config.model_config.max_model_len = 256
    with pytest.raises(ConfigError, match="chunk_tokens 512 is more than the engine's max_model_len 256"):
        KVHubConnector(config, KVConnectorRole.SCHEDULER)
    assert _connector(tmp_path, "kv_producer", chunk_tokens=16)  # the standin without max_model_len: accepted


@pytest.mark.parametrize(
    "option, value, says",
    [
        ("chunk_tokens", 0, "kv_connector_extra_config chunk_tokens must be a positive whole number"),
        ("kvstore_max_bytes", "1GiB", "kv_connector_extra_config kvstore_max_bytes must be a positive whole number"),
        ("require_isolation_key", "maybe", "kv_connector_extra_config require_isolation_key must be true or false"),
        ("select", "deviation", "select='deviation' in kv_connector_extra_config"),
        ("events_path", 5, "kv_connector_extra_config events_path must be a string"),
        ("hub_repo", ["a"], "kv_connector_extra_config hub_repo must be a string"),
    ],
)
def test_kvhub_serve_checks_with_the_connectors_own_constructor(tmp_path, option, value, says):
    """transfer_configs (what kvhub serve runs before any server starts) reads each role's keys with
    read_config, the constructor the connector runs at engine start: one validator.  Planted bug caught: a
    hand-picked subset of checks in transfer_configs, letting through a value every engine then refuses."""
    from kvhub.serving.launch import transfer_configs

    with pytest.raises(ConfigError, match=says):
        transfer_configs(kvstore_dir=tmp_path, source_model="s", mapper="a:b:c@latest", **{option: value})
    configs = transfer_configs(kvstore_dir=tmp_path, source_model="s", mapper="a:b:c@latest")
    for config in configs.values():
        read = connector.read_config(config["kv_connector_extra_config"])
        assert isinstance(read, connector.ConnectorConfig) and read.kvstore_dir == str(tmp_path)
