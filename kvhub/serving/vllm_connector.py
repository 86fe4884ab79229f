"""A vLLM v1 KV connector that hands a small model's prompt KV to a large model through a kvhub mapper.

One class, two roles (vLLM's ``kv_role``), configured through ``kv_connector_extra_config``
(docs/serving.md has the full table)::

    KVTransferConfig(kv_connector="KVHubConnector", kv_connector_module_path="kvhub.serving.vllm_connector",
                     kv_role="kv_producer" | "kv_consumer", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"kvstore_dir": "/dev/shm/kvhub", "source_model": "...",
                                                "mapper": "SRC:DST:CALIB@production"})  # consumer only

* producer (small model's engine): when a request's prompt is fully computed, its K/V (every layer,
  read from the paged blocks) goes into the :class:`~kvhub.serving.kvstore.KVStore` under
  (isolation key, source model, token-id prefix hashes).
* consumer (large model's engine): ``get_num_new_matched_tokens`` reports the longest stored prefix,
  block-aligned, minus ``exact_suffix`` tokens that vLLM computes itself (:func:`~kvhub.serving.paged.load_plan`);
  ``start_load_kv`` reads those source rows, maps them with :meth:`kvhub.core.mapper.Mapper.map_layers` at
  their absolute positions (RoPE stripped and re-applied), writes every layer into the allocated blocks
  with the attention backend's own writer, and then the large model itself recomputes the spec's tokens
  over them (the first ``exact_prefix`` and ``exact_budget`` of the prompt in whole sentences chosen by
  the small model's attention from the prompt's last tokens, which the producer stores with the KV, or with
  ``select=target`` by its own: :mod:`kvhub.serving.engine_pass`, the masked pass of
  :mod:`kvhub.serving.recompute`), all before vLLM's forward pass computes the rest.  The model comes
  from :class:`kvhub.serving.vllm_worker.KVHubWorker` (``--worker-cls``); without it the consumer maps
  only and says so on every load.
* The recompute spec is :class:`kvhub.serving.spec.Recompute`'s fields in ``kv_connector_extra_config``;
  a request may carry its own in ``kv_transfer_params["kvhub_recompute"]`` ("exact_budget=0.2,select=random"),
  ``kv_transfer_params["kvhub_control"]`` maps it with the no-information control map (evaluation), and
  ``kv_transfer_params["kvhub_prefill"]`` loads nothing (the large model's own prefill, to settle a
  conversation into its prefix cache).  The response's ``kv_transfer_params["kvhub"]`` says what was done.
* Mapped blocks, recomputed or not, are evicted from vLLM's prefix cache right after allocation, and every
  later block of the request (computed over them) each step and when it finishes: no later request reuses
  any of them as exact, even after the same tenant prefilled that prefix exactly.
* Isolation key: decided by the server's configuration, never by the client: the request's ``cache_salt``
  (default), or ``kv_transfer_params["kvhub_tenant"]`` with ``isolation_key_source="kvhub_tenant"``; else ""
  (one shared namespace; ``require_isolation_key`` turns that off).  A request naming its tenant through the
  other field (with ``kvhub_tenant``: a ``cache_salt`` and no ``kvhub_tenant``) is neither stored nor loaded
  (:func:`~kvhub.serving.connector_config.isolation_key`).
* Fallback is never silent (a log line, ``self.counters``, an ``events_path`` JSON line): a failed or
  non-finite map, write or recompute reports its blocks through ``get_block_ids_with_load_errors``, and
  vLLM prefills them (``kv_load_failure_policy="recompute"``).

The class is a facade, as vLLM's own connectors are laid out: by role it builds the scheduler side
(:class:`kvhub.serving.connector_scheduler.ConnectorScheduler`: matching, load plans, saves, reports) or the
worker side (:class:`kvhub.serving.connector_worker.ConnectorWorker`: mapping, writing, the recompute,
gathering saves), and every vLLM hook below is a delegation to it.  The scheduler side decides each step's
saves and loads once, into :mod:`kvhub.serving.connector_meta`'s typed jobs; the worker side executes only
those.  What both share (configuration, KV store, mapper, events): :mod:`kvhub.serving.connector_state`;
the configuration keys: :data:`kvhub.serving.connector_config.EXTRA_CONFIG`.
"""

from __future__ import annotations

import logging

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole

from kvhub.errors import ConfigError
from kvhub.serving.connector_config import (
    ConnectorConfig,
    check_chunk_tokens,
    check_target,
    events_file,
    load_mapper,
    read_config,
    worker_device,
)
from kvhub.serving.connector_scheduler import ConnectorScheduler
from kvhub.serving.connector_state import ConnectorState
from kvhub.serving.connector_worker import ConnectorWorker
from kvhub.serving.engine_limits import check_engine
from kvhub.serving.kvstore import KVStore
from kvhub.serving.launch import LOAD_FAILURE_POLICY, ROLES

log = logging.getLogger("kvhub.serving")


class KVHubConnector(KVConnectorBase_V1):
    """See the module docstring."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_engine(vllm_config)  # one rank, attention-only model: refused at start (engine_limits), never half-served
        transfer = vllm_config.kv_transfer_config
        config = read_config(transfer.kv_connector_extra_config)
        check_chunk_tokens(config.chunk_tokens, max_model_len=getattr(vllm_config.model_config, "max_model_len", None))
        events_file(config.events_path)  # an appendable regular file, checked now rather than at the first event
        if transfer.kv_role not in ROLES.values():
            raise ConfigError(f"KVHubConnector runs as {' or '.join(ROLES.values())}, not {transfer.kv_role!r}")
        is_producer = transfer.kv_role == ROLES["producer"]
        self.state = ConnectorState(
            role_name="producer" if is_producer else "consumer",
            block_size=vllm_config.cache_config.block_size,
            config=config,
            kvstore=KVStore(config.kvstore_dir, max_bytes=config.kvstore_max_bytes, chunk_tokens=config.chunk_tokens),
        )
        if is_producer:
            self.state.source_model = config.source_model or vllm_config.model_config.model
        else:
            self._init_consumer(vllm_config, config)
        self.connector_scheduler: ConnectorScheduler | None = None
        self.connector_worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = ConnectorScheduler(self.state, lambda: self._kv_cache_manager)
        else:
            tokenizer = None if vllm_config.model_config.skip_tokenizer_init else vllm_config.model_config.tokenizer
            self.connector_worker = ConnectorWorker(
                self.state, metadata=self._get_connector_metadata, tokenizer_name=tokenizer
            )

    def _init_consumer(self, vllm_config, config: ConnectorConfig) -> None:
        state = self.state
        device = "cpu" if self.role == KVConnectorRole.SCHEDULER else worker_device(vllm_config)
        try:
            state.mapper = load_mapper(config, device=device)
            state.source_model = config.source_model or state.mapper.source["model_id"]
            check_target(state.mapper, vllm_config)
        except Exception as exc:  # noqa: BLE001 - any failure to get a usable mapper means: prefill, visibly
            state.refusal = f"{type(exc).__name__}: {exc}"
            state.source_model = config.source_model or ""
            log.error("kvhub consumer disabled, every request falls back to prefill: %s", state.refusal)
        if vllm_config.kv_transfer_config.kv_load_failure_policy != LOAD_FAILURE_POLICY:
            log.warning(
                "kvhub consumer: set kv_load_failure_policy=%r so a failed map falls back to prefill instead "
                "of failing the request",
                LOAD_FAILURE_POLICY,
            )

    @property
    def counters(self):
        """Events so far, by name (``hit``, ``fallback``, ``saved``, ...)."""
        return self.state.counters

    @property
    def _scheduler(self) -> ConnectorScheduler:
        if self.connector_scheduler is None:
            raise RuntimeError("a scheduler-side hook was called on the worker-side connector")
        return self.connector_scheduler

    @property
    def _worker(self) -> ConnectorWorker:
        if self.connector_worker is None:
            raise RuntimeError("a worker-side hook was called on the scheduler-side connector")
        return self.connector_worker

    # ---- Scheduler Side Methods ---------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def on_new_request(self, request) -> None:
        self._scheduler.on_new_request(request)

    def update_connector_output(self, connector_output) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids):
        return self._scheduler.request_finished(request, block_ids)

    # ---- Worker Side Methods ------------------------------------------------------------------------
    def attach_model(self, model) -> None:
        """Called by :class:`kvhub.serving.vllm_worker.KVHubWorker` once the model is loaded."""
        self._worker.attach_model(model)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self._worker.start_load_kv(forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: start_load_kv wrote every layer (the recompute needs them all first)."""

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        self._worker.save_kv_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save()

    def build_connector_worker_meta(self):
        return self._worker.build_connector_worker_meta()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()
