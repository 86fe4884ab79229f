"""The vLLM connector's two sides, end to end without vLLM (its base classes stood in: tests/vllm_standin.py):
the scheduler side of a consumer matches a stored prompt and queues a load; the worker side, a separate
connector as vLLM makes one per role, maps the stored rows and writes them into the request's slots with
the attention backend's writer; its report reaches the response.  The real engine: tests/serving/test_vllm_connector.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.fixtures_store import SRC_ID, make_store_artifact, store_fingerprint
from tests.vllm_standin import BlockManager, request, vllm_config, vllm_modules  # noqa: F401

PROMPT = [(5 * i + 2) % 90 + 1 for i in range(80)]
MATCHED = 64  # 80 tokens, the last 16 computed by the engine (exact_suffix), in 16-token blocks
TARGET = "Qwen/Tiny-Coder-1.5B-Instruct"


def _stored(kvstore_dir) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    from kvhub.serving.kvstore import KVStore

    src = store_fingerprint(SRC_ID)
    g = torch.Generator().manual_seed(1)
    shape = (src["num_kv_heads"], len(PROMPT), src["head_dim"])
    keys = [torch.randn(*shape, generator=g) for _ in range(src["num_layers"])]
    values = [torch.randn(*shape, generator=g) for _ in range(src["num_layers"])]
    KVStore(kvstore_dir, max_bytes=1 << 26).put(
        isolation_key="", source_model=SRC_ID, token_ids=PROMPT, keys=keys, values=values
    )
    return keys, values


class _Backend:
    """The attention backend's writer, as the worker side calls it: records (keys, values, slots)."""

    def __init__(self):
        self.writes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def do_kv_cache_update(self, layer, keys, values, kv_cache, slots):
        self.writes.append((keys, values, slots))


def _consumer(tmp_path, side: str):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvhub.serving.vllm_connector import KVHubConnector

    artifact = tmp_path / "artifact"
    if not artifact.exists():
        make_store_artifact(artifact)
    options = {
        "kvstore_dir": str(tmp_path / "kvstore"),
        "mapper_path": str(artifact),
        "exact_prefix": 0,
        "exact_budget": 0,  # maps only: the recompute needs the engine's model
        "min_escalation_tokens": 0,
    }  # an 80-token prompt: escalated all the same
    config = vllm_config(role="kv_consumer", extra=options, target=dict(store_fingerprint(TARGET)))
    connector = KVHubConnector(config, getattr(KVConnectorRole, side))
    connector._kv_cache_manager = BlockManager()
    return connector, artifact


def test_a_load_crosses_from_the_scheduler_side_to_the_worker_side(tmp_path, vllm_modules):
    """Known answer: each target layer's writes are the mapper's own map of the stored rows [0, 64) at
    their absolute positions, at the request's slots 0..63.  Planted bugs caught: the worker reading the
    wrong rows or positions, writing keys as values, layers out of order, slots shifted by a block; the
    report not reaching the response; a side built for the wrong role."""
    from kvhub.core.mapper import Mapper

    keys, values = _stored(tmp_path / "kvstore")
    scheduler, artifact = _consumer(tmp_path, "SCHEDULER")
    worker, _ = _consumer(tmp_path, "WORKER")
    assert scheduler.connector_worker is None and worker.connector_scheduler is None
    req = request("r1", PROMPT)
    matched, _ = scheduler.get_num_new_matched_tokens(req, 0)
    assert matched == MATCHED
    scheduler.update_state_after_alloc(req, None, matched)
    worker.bind_connector_metadata(scheduler.build_connector_meta(None))

    target = store_fingerprint(TARGET)
    backends = [_Backend() for _ in range(target["num_layers"])]
    layers = {
        f"model.layers.{m}.self_attn.attn": SimpleNamespace(kv_cache=torch.zeros(1), impl=backend)
        for m, backend in enumerate(backends)
    }
    worker.start_load_kv(SimpleNamespace(no_compile_layers=layers))
    assert worker.get_block_ids_with_load_errors() == set()

    mapper = Mapper.load(artifact, device="cpu")
    positions = torch.arange(MATCHED).unsqueeze(0)
    expected = mapper.map_layers(
        [k[None, :, :MATCHED] for k in keys], [v[None, :, :MATCHED] for v in values], positions, dtype=torch.float32
    )
    for backend, (k, v) in zip(backends, expected):
        ((written_k, written_v, slots),) = backend.writes
        assert torch.equal(slots, torch.arange(MATCHED))
        torch.testing.assert_close(written_k, k[0].transpose(0, 1))
        torch.testing.assert_close(written_v, v[0].transpose(0, 1))

    response = scheduler.request_finished(req, [])[1]["kvhub"]
    scheduler.update_connector_output(SimpleNamespace(kv_connector_worker_meta=worker.build_connector_worker_meta()))
    assert response["mapped_tokens"] == MATCHED and response["deshrink"] == mapper.deshrink
    assert response["transfer_status"] == "applied"  # the router's word (semantic-router's kv-transfer-status)
    assert scheduler.counters["hit"] == 1 and worker.counters["mapped"] == 1 and worker.counters["written"] == 1


def test_a_load_that_fails_after_its_report_went_out_says_fallback_to_the_router(tmp_path, vllm_modules):
    """The report handed out by request_finished says ``transfer_status: applied`` for a planned load; when the
    worker then reports that load failed (a 1-token request finishes in its load step), the same report turns
    to ``fallback_reprefill`` with the reason.  Planted bugs caught: the status computed once and never
    updated; a status on a report the connector never handed out."""
    from kvhub.serving.connector_meta import KVHubWorkerMetadata

    _stored(tmp_path / "kvstore")
    scheduler, _ = _consumer(tmp_path, "SCHEDULER")
    req = request("r3", PROMPT)
    matched, _ = scheduler.get_num_new_matched_tokens(req, 0)
    scheduler.update_state_after_alloc(req, None, matched)
    scheduler.build_connector_meta(None)
    response = scheduler.request_finished(req, [])[1]["kvhub"]
    assert response["transfer_status"] == "applied"
    failed = KVHubWorkerMetadata({"r3": {"fallback": "RuntimeError: boom"}, "other": {"fallback": "x"}})
    scheduler.update_connector_output(SimpleNamespace(kv_connector_worker_meta=failed))
    assert response["transfer_status"] == "fallback_reprefill" and response["fallback"] == "RuntimeError: boom"


def test_a_load_whose_entry_was_evicted_is_reported_for_prefill(tmp_path, vllm_modules):
    """The worker side never writes a load without its pinned entry: the blocks go back to vLLM."""
    from kvhub.serving.connector_meta import KVHubConnectorMetadata, LoadJob
    from kvhub.serving.spec import Recompute

    _stored(tmp_path / "kvstore")
    worker, _ = _consumer(tmp_path, "WORKER")
    job = LoadJob("r2", "", PROMPT, 0, MATCHED, list(range(MATCHED)), [0, 1, 2, 3], Recompute())
    worker.bind_connector_metadata(KVHubConnectorMetadata(loads=[job]))
    backend = _Backend()
    worker.start_load_kv(
        SimpleNamespace(
            no_compile_layers={"model.layers.0.self_attn.attn": SimpleNamespace(kv_cache=torch.zeros(1), impl=backend)}
        )
    )
    assert worker.get_block_ids_with_load_errors() == {0, 1, 2, 3} and not backend.writes
    assert worker.counters["fallback"] == 1


def test_a_hook_of_the_other_side_is_refused(tmp_path, vllm_modules):
    scheduler, _ = _consumer(tmp_path, "SCHEDULER")
    with pytest.raises(RuntimeError, match="worker-side hook"):
        scheduler.get_block_ids_with_load_errors()


def test_a_disabled_consumer_says_unsupported_to_the_router(tmp_path, vllm_modules):
    """A consumer that could not load its mapper at start maps nothing: every response says
    ``transfer_status: unsupported`` with the reason, and the large model prefills.  Planted bugs caught: the
    disabled consumer reported as a plain fallback (a router would keep trying the pair), or not at all."""
    _stored(tmp_path / "kvstore")
    scheduler, _ = _consumer(tmp_path, "SCHEDULER")
    scheduler.connector_scheduler.state.refusal = "IncompatibleError: the mapper's target is another model"
    req = request("r9", PROMPT)
    assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
    response = scheduler.request_finished(req, [])[1]["kvhub"]
    assert response["transfer_status"] == "unsupported" and response["fallback"] == "prefill"
    assert "consumer disabled: IncompatibleError" in response["reason"] and response["mapped_tokens"] == 0
