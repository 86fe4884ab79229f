"""A stand-in for the few vLLM names kvhub's connector and logits processor import, so their request
handling is tested without vLLM (tests/serving/test_vllm_connector.py runs the real engine where .venv-vllm exists).

``vllm_modules`` is a fixture: where vLLM is not installed it puts stand-in modules in ``sys.modules`` for
the test and removes them (and every kvhub module imported over them) afterwards, so later tests that probe
``import vllm`` still see no vLLM.
"""

from __future__ import annotations

import enum
import sys
import types
from types import SimpleNamespace

import pytest

_KVHUB_OVER_VLLM = (
    "kvhub.serving.vllm_connector",
    "kvhub.serving.connector_scheduler",
    "kvhub.serving.connector_worker",
    "kvhub.serving.connector_meta",
    "kvhub.serving.forced",
)


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:
    pass


class KVConnectorWorkerMetadata:
    pass


class KVConnectorBase_V1:  # noqa: N801 - vLLM's name
    def __init__(self, vllm_config, role, kv_cache_config=None):
        self._vllm_config, self._role, self._connector_metadata = vllm_config, role, None

    @property
    def role(self):
        return self._role

    def bind_connector_metadata(self, metadata):
        self._connector_metadata = metadata

    def _get_connector_metadata(self):
        return self._connector_metadata


class SamplingParams:
    def __init__(self, extra_args=None):
        self.extra_args = extra_args


class AdapterLogitsProcessor:
    def __init__(self, vllm_config, device, is_pin_memory):
        self.vllm_config = vllm_config


def _modules() -> dict[str, types.ModuleType]:
    names = {
        "vllm": {"SamplingParams": SamplingParams},
        "vllm.distributed": {},
        "vllm.distributed.kv_transfer": {},
        "vllm.distributed.kv_transfer.kv_connector": {},
        "vllm.distributed.kv_transfer.kv_connector.v1": {},
        "vllm.distributed.kv_transfer.kv_connector.v1.base": {
            "KVConnectorBase_V1": KVConnectorBase_V1,
            "KVConnectorMetadata": KVConnectorMetadata,
            "KVConnectorRole": KVConnectorRole,
            "KVConnectorWorkerMetadata": KVConnectorWorkerMetadata,
        },
        "vllm.v1": {},
        "vllm.v1.sample": {},
        "vllm.v1.sample.logits_processor": {"AdapterLogitsProcessor": AdapterLogitsProcessor},
    }
    modules = {}
    for name, attrs in names.items():
        module = types.ModuleType(name)
        module.__path__ = []  # a package, so the dotted imports below it resolve
        module.__dict__.update(attrs)
        modules[name] = module
    return modules


@pytest.fixture
def vllm_modules(monkeypatch):
    """The real vLLM where it is installed, else the stand-in (for this test only)."""
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: no usable vLLM here
        for name, module in _modules().items():
            monkeypatch.setitem(sys.modules, name, module)
        for name in _KVHUB_OVER_VLLM:
            monkeypatch.delitem(sys.modules, name, raising=False)
        yield "stand-in"
        import kvhub.serving

        for name in _KVHUB_OVER_VLLM:
            sys.modules.pop(name, None)
            kvhub.serving.__dict__.pop(name.rsplit(".", 1)[1], None)
        return
    yield "vllm"


def vllm_config(*, role: str, extra: dict, target: dict | None = None, block_size: int = 16):
    """A stand-in VllmConfig with what the connector reads: the transfer config, block size, served model
    (``target``: the mapper's target fingerprint, so check_target passes)."""
    target = target or {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "model_id": "served"}
    model = SimpleNamespace(
        skip_tokenizer_init=True,
        tokenizer=None,
        model=target["model_id"],
        hf_config=SimpleNamespace(num_hidden_layers=target["num_layers"]),
        get_num_kv_heads=lambda parallel: target["num_kv_heads"],
        get_head_size=lambda: target["head_dim"],
    )
    transfer = SimpleNamespace(kv_role=role, kv_connector_extra_config=extra, kv_load_failure_policy="recompute")
    return SimpleNamespace(
        kv_transfer_config=transfer,
        cache_config=SimpleNamespace(block_size=block_size),
        model_config=model,
        device_config=SimpleNamespace(device="cpu"),
        parallel_config=None,
    )


class BlockManager:
    """The scheduler's KV cache manager as the consumer uses it: block ids per request, and the block pool's
    evict_blocks (recorded in ``evicted``)."""

    def __init__(self, blocks: int = 64):
        self.evicted: list[set[int]] = []  # each evict_blocks call's block ids, in order
        self.block_pool = SimpleNamespace(evict_blocks=self.evicted.append)
        self.blocks = list(range(blocks))

    def get_block_ids(self, request_id):
        return (self.blocks,)


def request(request_id: str, prompt: list[int], *, cache_salt=None, params=None):
    return SimpleNamespace(
        request_id=request_id, prompt_token_ids=list(prompt), cache_salt=cache_salt, kv_transfer_params=params
    )


def scheduler_output(new_requests: list) -> SimpleNamespace:
    """One step that schedules each request's whole prompt for the first time."""
    new = [
        SimpleNamespace(
            req_id=r.request_id,
            prompt_token_ids=r.prompt_token_ids,
            num_computed_tokens=0,
            block_ids=(list(range(len(r.prompt_token_ids) // 16 + 1)),),
        )
        for r in new_requests
    ]
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    return SimpleNamespace(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        finished_req_ids=set(),
        num_scheduled_tokens={r.request_id: len(r.prompt_token_ids) for r in new_requests},
    )
