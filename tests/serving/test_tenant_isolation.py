"""Tenant isolation in the KV connector is the server's decision, never the client's (reliability-3 R3-1).

The namespace a request stores into and loads from comes from the one field the operator configured
(``isolation_key_source``: vLLM's ``cache_salt`` by default); a client's ``kv_transfer_params.kvhub_tenant``
neither overrides it nor satisfies ``require_isolation_key``, and the response of a refused request says
nothing about what another tenant stored.  Driven through the connector's own scheduler methods (vLLM's base
classes stood in for where vLLM is not installed: tests/vllm_standin.py).
"""

from __future__ import annotations

import pytest
import torch

from kvhub.errors import ConfigError
from tests.fixtures_store import SRC_ID, make_store_artifact, store_fingerprint
from tests.vllm_standin import BlockManager, request, scheduler_output, vllm_config, vllm_modules  # noqa: F401

PROMPT = [(7 * i + 3) % 90 + 1 for i in range(80)]
MATCHED = 64  # 80 tokens, the last 16 computed by the engine (exact_suffix), in 16-token blocks


def _store_prompt(kvstore_dir, tenant: str) -> None:
    from kvhub.serving.kvstore import KVStore

    src = store_fingerprint(SRC_ID)
    g = torch.Generator().manual_seed(0)
    shape = (src["num_kv_heads"], len(PROMPT), src["head_dim"])
    keys = [torch.randn(*shape, generator=g) for _ in range(src["num_layers"])]
    values = [torch.randn(*shape, generator=g) for _ in range(src["num_layers"])]
    KVStore(kvstore_dir, max_bytes=1 << 26).put(
        isolation_key=tenant, source_model=SRC_ID, token_ids=PROMPT, keys=keys, values=values
    )


def _connector(tmp_path, role: str, **extra):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvhub.serving.vllm_connector import KVHubConnector

    # an 80-token prompt: escalated, below the default min_escalation_tokens (tests/serving/test_escalation_fallback.py)
    options = {"kvstore_dir": str(tmp_path / "kvstore"), "min_escalation_tokens": 0, **extra}
    target = None
    if role == "kv_consumer":
        artifact = tmp_path / "artifact"
        if not artifact.exists():
            make_store_artifact(artifact)
        options["mapper_path"] = str(artifact)
        target = dict(store_fingerprint("Qwen/Tiny-Coder-1.5B-Instruct"))
    connector = KVHubConnector(vllm_config(role=role, extra=options, target=target), KVConnectorRole.SCHEDULER)
    connector._kv_cache_manager = BlockManager()
    return connector


def _ask(connector, req) -> tuple[int, dict | None]:
    """(tokens the consumer loads, the response's kv_transfer_params) of one request."""
    matched, _ = connector.get_num_new_matched_tokens(req, 0)
    connector.update_state_after_alloc(req, None, matched)
    return matched, connector.request_finished(req, [])[1]


ATTACKS = [  # (connector options, cache_salt, kv_transfer_params): none may reach alice's namespace
    pytest.param({}, "bob-salt", {"kvhub_tenant": "alice-salt"}, id="tenant-overrides-salt"),
    pytest.param(
        {"require_isolation_key": True},
        None,
        {"kvhub_tenant": "alice-salt"},
        id="tenant-satisfies-require-isolation-key",
    ),
    pytest.param({}, None, {"kvhub_tenant": "alice-salt"}, id="tenant-without-salt"),
    pytest.param(
        {"isolation_key_source": "kvhub_tenant"},
        "alice-salt",
        {"kvhub_tenant": "bob-salt"},
        id="salt-overrides-configured-tenant",
    ),
    pytest.param(
        {"isolation_key_source": "kvhub_tenant", "require_isolation_key": True},
        "alice-salt",
        {},
        id="salt-satisfies-require-when-tenant-configured",
    ),
]


@pytest.mark.parametrize("options, salt, params", ATTACKS)
def test_a_client_cannot_pick_another_tenants_namespace(tmp_path, vllm_modules, options, salt, params):
    _store_prompt(tmp_path / "kvstore", "alice-salt")
    consumer = _connector(tmp_path, "kv_consumer", **options)
    matched, response = _ask(consumer, request("attack", PROMPT, cache_salt=salt, params=params))
    assert matched == 0 and response is None  # no load, and nothing that tells a hit from a refusal
    assert consumer.counters["fallback"] == 1 and consumer.counters["hit"] == 0


OWN = [  # the same lookups made by alice herself, the way the server is configured: found
    pytest.param({}, "alice-salt", None, id="own-salt"),
    pytest.param({"require_isolation_key": True}, "alice-salt", {"kvhub_control": False}, id="own-salt-required"),
    pytest.param(
        {"isolation_key_source": "kvhub_tenant"},
        "bob-salt",
        {"kvhub_tenant": "alice-salt"},
        id="own-configured-tenant",
    ),
]


@pytest.mark.parametrize("options, salt, params", OWN)
def test_the_configured_field_finds_its_own_tenant(tmp_path, vllm_modules, options, salt, params):
    _store_prompt(tmp_path / "kvstore", "alice-salt")
    consumer = _connector(tmp_path, "kv_consumer", **options)
    matched, response = _ask(consumer, request("own", PROMPT, cache_salt=salt, params=params))
    assert matched == MATCHED and response["kvhub"]["mapped_tokens"] == MATCHED


@pytest.mark.parametrize(
    "tenant",
    [0, False, 7, ["alice-salt"], {"a": 1}],
    ids=["zero", "false", "int", "list", "dict"],
)
def test_a_tenant_that_is_not_a_string_is_refused_not_shared(tmp_path, vllm_modules, tenant):
    """``kvhub_tenant`` 0 or false used to fall into the shared "" namespace silently."""
    _store_prompt(tmp_path / "kvstore", "")
    consumer = _connector(tmp_path, "kv_consumer", isolation_key_source="kvhub_tenant")
    matched, response = _ask(consumer, request("odd", PROMPT, params={"kvhub_tenant": tenant}))
    assert matched == 0 and response is None
    assert consumer.counters["fallback"] == 1


def test_the_producer_stores_under_the_salt_only(tmp_path, vllm_modules):
    producer = _connector(tmp_path, "kv_producer", source_model=SRC_ID)
    honest = request("honest", PROMPT, cache_salt="bob-salt")
    forged = request("forged", PROMPT, cache_salt="bob-salt", params={"kvhub_tenant": "alice-salt"})
    for req in (honest, forged):
        producer.on_new_request(req)
    saves = producer.build_connector_meta(scheduler_output([honest, forged])).saves
    assert [(job.request_id, job.isolation_key) for job in saves] == [("honest", "bob-salt")]
    assert producer.counters["save_failed"] == 1  # the forged one: said, not stored anywhere


@pytest.mark.parametrize("value", ["kvhub-tenant", "", None, True, "KVHUB_TENANT"])
def test_isolation_key_source_is_checked_at_start(tmp_path, vllm_modules, value):
    with pytest.raises(ConfigError, match="isolation_key_source must be one of"):
        _connector(tmp_path, "kv_producer", isolation_key_source=value)


def test_transfer_configs_gives_both_roles_the_same_source(tmp_path):
    from kvhub.serving.launch import transfer_configs

    configs = transfer_configs(
        kvstore_dir=tmp_path, source_model="s", mapper="a:b:c@latest", isolation_key_source="kvhub_tenant"
    )
    assert {c["kv_connector_extra_config"]["isolation_key_source"] for c in configs.values()} == {"kvhub_tenant"}
    with pytest.raises(ConfigError, match="isolation_key_source"):
        transfer_configs(kvstore_dir=tmp_path, source_model="s", mapper="a:b:c@latest", isolation_key_source="x")


def _named(name: str, by: str, prompt=PROMPT):
    """A request of tenant ``name``, who names itself by its ``cache_salt`` ("salt") or ``kvhub_tenant`` ("key")."""
    if by == "salt":
        return request(name, prompt, cache_salt=name)
    return request(name, prompt, params={"kvhub_tenant": name})


NAMING = [  # (isolation_key_source, how alice and bob name themselves, how carol does)
    pytest.param("kvhub_tenant", "salt", "salt", id="tenant-source-salt-only"),
    pytest.param("kvhub_tenant", "key", "key", id="tenant-source-key-only"),
    pytest.param("kvhub_tenant", "key", "salt", id="tenant-source-mixed-key-then-salt"),
    pytest.param("kvhub_tenant", "salt", "key", id="tenant-source-mixed-salt-then-key"),
    pytest.param("cache_salt", "salt", "salt", id="salt-source-salt-only"),
]


@pytest.mark.parametrize("source, savers, carol", NAMING)
def test_no_tenant_sees_another_tenants_prompt_whatever_field_names_it(tmp_path, vllm_modules, source, savers, carol):
    """Alice and bob send the same prompt to the producer; whatever the stand-in worker stores for each save
    job, carol's request with that prompt loads nothing and learns nothing, and bob's own is found when he
    names himself by the configured field.  With ``isolation_key_source: kvhub_tenant`` a request naming its
    tenant only by ``cache_salt`` is neither stored nor loaded (``save_failed``/``fallback``), never the
    shared "" namespace.

    Planted bugs caught: a request with a ``cache_salt`` but no ``kvhub_tenant`` keyed "" in the opt-in mode
    (bob's prompt matched for carol, and its report returned to her); the salt read as the key in the opt-in
    mode (a client then picks its namespace); a refused save stored anyway."""
    producer = _connector(tmp_path, "kv_producer", source_model=SRC_ID, isolation_key_source=source)
    tenants = [_named("alice-salt", savers), _named("bob-salt", savers)]
    for req in tenants:
        producer.on_new_request(req)
    saves = producer.build_connector_meta(scheduler_output(tenants)).saves
    for job in saves:  # the worker side stores each job under its key
        _store_prompt(tmp_path / "kvstore", job.isolation_key)
    takes_field = savers == "key" or source == "cache_salt"
    assert sorted(job.isolation_key for job in saves) == (["alice-salt", "bob-salt"] if takes_field else [])
    assert producer.counters["save_failed"] == (0 if takes_field else 2)

    consumer = _connector(tmp_path, "kv_consumer", isolation_key_source=source)
    matched, response = _ask(consumer, _named("carol-salt", carol))
    assert matched == 0 and response is None  # neither a load nor a report that tells a hit from a miss
    if takes_field:  # the control: bob finds his own prompt through the configured field
        matched, response = _ask(consumer, _named("bob-salt", savers))
        assert matched == MATCHED and response["kvhub"]["mapped_tokens"] == MATCHED


def test_a_salt_without_kvhub_tenant_is_refused_by_name_when_the_tenant_field_is_configured():
    """The review's reproduction: two salts, one key "" before; now a ConfigError naming both fields and the fix.

    Planted bugs caught: "" for a salted request in the opt-in mode; a refusal that names neither field."""
    import types

    from kvhub.serving.connector_config import isolation_key

    for salt in ("bob", "carol"):
        req = types.SimpleNamespace(cache_salt=salt, kv_transfer_params=None)
        with pytest.raises(ConfigError, match=r"cache_salt.*isolation_key_source is kvhub_tenant.*kvhub_tenant"):
            isolation_key(req, source="kvhub_tenant", required=False)
    req = types.SimpleNamespace(cache_salt=None, kv_transfer_params={"kvhub_tenant": "bob"})
    assert isolation_key(req, source="kvhub_tenant", required=False) == "bob"
    assert (
        isolation_key(
            types.SimpleNamespace(cache_salt=None, kv_transfer_params=None), source="kvhub_tenant", required=False
        )
        == ""
    )
