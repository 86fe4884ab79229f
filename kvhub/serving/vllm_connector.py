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
  its own attention from the prompt's last tokens: :mod:`kvhub.serving.engine_pass`, the masked pass of
  :mod:`kvhub.serving.recompute`), all before vLLM's forward pass computes the rest.  The model comes
  from :class:`kvhub.serving.vllm_worker.KVHubWorker` (``--worker-cls``); without it the consumer maps
  only and says so on every load.
* The recompute spec is :class:`kvhub.serving.spec.Recompute`'s fields in ``kv_connector_extra_config``;
  a request may carry its own in ``kv_transfer_params["kvhub_recompute"]`` ("exact_budget=0.2,select=random"),
  and ``kv_transfer_params["kvhub_control"]`` maps it with the no-information control map (evaluation).
  The response's ``kv_transfer_params["kvhub"]`` says what was mapped and recomputed.
* Mapped blocks, recomputed or not, are evicted from vLLM's prefix cache right after allocation: no later
  request reuses them (or the blocks chained after them) as exact.
* Isolation key: decided by the server's configuration, never by the client: the request's ``cache_salt``
  (default), or ``kv_transfer_params["kvhub_tenant"]`` with ``isolation_key_source="kvhub_tenant"``; else ""
  (one shared namespace; ``require_isolation_key`` turns that off).  A request naming its tenant through the
  other field is neither stored nor loaded (:func:`~kvhub.serving.connector_config.isolation_key`).
* Fallback is never silent (a log line, ``self.counters``, an ``events_path`` JSON line): a failed or
  non-finite map, write or recompute reports its blocks through ``get_block_ids_with_load_errors``, and
  vLLM prefills them (``kv_load_failure_policy="recompute"``).

The scheduler side decides each step's saves and loads once, into :mod:`kvhub.serving.connector_meta`'s
typed jobs; the worker side executes only those.  Configuration checks: :mod:`kvhub.serving.connector_config`.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole

from kvhub.errors import ConfigError, IncompatibleError, UnsupportedModelError
from kvhub.serving.connector_config import (check_serving_spec, check_target, config_count, config_deshrink,
                                            config_flag, config_isolation_source, events_file, isolation_key,
                                            load_mapper, request_control, request_spec, span_tokenizer, worker_device)
from kvhub.serving.connector_meta import KVHubConnectorMetadata, KVHubWorkerMetadata, LoadJob, SaveJob
from kvhub.serving.engine_limits import check_engine
from kvhub.serving.engine_pass import exact_positions, load_counts
from kvhub.serving.kvstore import KVStore
from kvhub.serving.launch import EXTRA_DEFAULTS, LOAD_FAILURE_POLICY, ROLES, WORKER_CLASS, check_extra_keys
from kvhub.serving.paged import PagedLayout, layer_layout, load_plan
from kvhub.serving.spec import Recompute

log = logging.getLogger("kvhub.serving")

_LAYER_NUMBER = re.compile(r"layers\.(\d+)\.")
DEFAULTS = EXTRA_DEFAULTS  # the configuration contract (class, module, roles, keys) is kvhub.serving.launch's


@dataclass
class _Tracked:
    """Producer bookkeeping of one running request (scheduler side)."""

    isolation_key: str
    token_ids: list[int]
    block_ids: list[int]
    computed: int = 0
    saved: bool = False


class KVHubConnector(KVConnectorBase_V1):
    """See the module docstring."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_engine(vllm_config)  # one rank, attention-only model: refused at start (engine_limits), never half-served
        transfer = vllm_config.kv_transfer_config
        extra = {**DEFAULTS, **(transfer.kv_connector_extra_config or {})}
        check_extra_keys(extra)
        if "kvstore_dir" not in extra:
            raise ConfigError("kv_connector_extra_config needs 'kvstore_dir': a directory both engines can reach")
        self.is_producer = transfer.kv_role == ROLES["producer"]
        if transfer.kv_role not in ROLES.values():
            raise ConfigError(f"KVHubConnector runs as {' or '.join(ROLES.values())}, not {transfer.kv_role!r}")
        self.block_size = vllm_config.cache_config.block_size
        self.recompute = Recompute.from_options(extra, origin="kv_connector_extra_config")
        self.exact_suffix = max(self.recompute.exact_suffix, 1)
        self.require_isolation_key = config_flag(extra, "require_isolation_key")
        self.isolation_source = config_isolation_source(extra)
        self.kvstore = KVStore(extra["kvstore_dir"], max_bytes=config_count(extra, "kvstore_max_bytes"),
                               chunk_tokens=config_count(extra, "chunk_tokens"))
        self.events_path = events_file(extra.get("events_path"))
        self.counters: Counter[str] = Counter()
        self._role_name = "producer" if self.is_producer else "consumer"
        self._lock = threading.Lock()
        self.mapper = None
        self._control = None  # the control map, made on the first request that asks for it
        self.refusal: str | None = None
        self.engine = None  # the recompute's pass over the engine's model (attach_model)
        self.tokenizer_name = None if vllm_config.model_config.skip_tokenizer_init else \
            vllm_config.model_config.tokenizer
        self._tokenizer: Any = False  # False: not loaded yet; None: none (16-token spans)
        if self.is_producer:
            self.source_model = extra.get("source_model") or vllm_config.model_config.model
        else:
            self._init_consumer(vllm_config, extra)
        # scheduler side
        self._requests: dict[str, Any] = {}  # producer: request objects, for their isolation keys
        self._tracked: dict[str, _Tracked] = {}
        self._matched: dict[str, tuple[Any, int, int]] = {}  # request id -> (stored prefix, start, end)
        self._loads: list[LoadJob] = []
        self._load_reports: dict[str, dict] = {}  # request id -> what its load did (returned at its end)
        self._finishing: dict[str, dict] = {}  # reports of requests finished this step (update_connector_output)
        # worker side
        self._layouts: dict[tuple, PagedLayout] = {}
        self._collected: dict[str, dict] = {}  # request id -> {layer: (K, V)} or {"error": why}
        self._layers: dict[str, Any] = {}
        self._load_errors: set[int] = set()
        self._step_reports: dict[str, dict] = {}  # request id -> its load's report, sent with this step's output

    # ---- configuration ---------------------------------------------------------------------------
    def _init_consumer(self, vllm_config, extra: dict) -> None:
        device = "cpu" if self.role == KVConnectorRole.SCHEDULER else worker_device(vllm_config)
        config_deshrink(extra)  # a bad value is a configuration error at start, not a disabled consumer
        try:
            self.mapper = load_mapper(extra, device=device)
            self.source_model = extra.get("source_model") or self.mapper.source["model_id"]
            check_target(self.mapper, vllm_config)
        except Exception as exc:  # noqa: BLE001 - any failure to get a usable mapper means: prefill, visibly
            self.refusal = f"{type(exc).__name__}: {exc}"
            self.source_model = extra.get("source_model", "")
            log.error("kvhub consumer disabled, every request falls back to prefill: %s", self.refusal)
        check_serving_spec(self.recompute, origin="kv_connector_extra_config")
        if vllm_config.kv_transfer_config.kv_load_failure_policy != LOAD_FAILURE_POLICY:
            log.warning("kvhub consumer: set kv_load_failure_policy=%r so a failed map falls back to prefill instead "
                        "of failing the request", LOAD_FAILURE_POLICY)

    def attach_model(self, model) -> None:
        """Called by :class:`kvhub.serving.vllm_worker.KVHubWorker` once the model is loaded: the recompute
        runs its decoder layers.  A model the pass cannot run leaves the consumer mapping only, visibly."""
        if self.is_producer:
            return
        from kvhub.serving.engine_pass import EnginePass

        try:
            self.engine = EnginePass(model)
        except UnsupportedModelError as exc:
            log.error("kvhub consumer: no selective recompute for this model, requests are mapped only: %s", exc)

    def _control_mapper(self):
        if self._control is None:
            from kvhub.core.control import control_mapper

            self._control = control_mapper(self.mapper)
        return self._control

    def _event(self, event: str, request_id: str, **fields) -> None:
        self.counters[event] += 1
        if event == "fallback":
            log.info("kvhub %s: request %s is prefilled normally: %s (%d fallbacks so far)", self._role_name,
                     request_id, fields.get("reason"), self.counters[event])
        if self.events_path:
            line = json.dumps({"time": time.time(), "role": self._role_name, "event": event,
                               "request_id": request_id, **fields})
            try:
                with self._lock, open(self.events_path, "a") as f:
                    f.write(line + "\n")
            except OSError as exc:  # the events file is a log: losing a line never touches the request
                if not self.counters["events_lost"]:
                    log.warning("kvhub %s: cannot append to events_path %s (%s); events are lost until it is "
                                "writable again", self._role_name, self.events_path, exc)
                self.counters["events_lost"] += 1

    def _isolation_key(self, request) -> str | None:
        """ConfigError for a request that names its tenant the wrong way (see connector_config.isolation_key)."""
        return isolation_key(request, source=self.isolation_source, required=self.require_isolation_key)

    # ---- scheduler side ---------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.is_producer:
            return 0, False
        try:
            reason, plan = self._plan(request, num_computed_tokens)
        except ConfigError as exc:  # the request's own kvhub_recompute spec
            reason, plan = f"bad kv_transfer_params: {exc}", None
        except Exception as exc:  # noqa: BLE001 - an unreadable KV store is a miss, never a dead scheduler
            reason, plan = f"KV store lookup failed: {type(exc).__name__}: {exc}", None
        if plan is None:
            self._event("fallback", request.request_id, reason=reason, local_hit_tokens=num_computed_tokens,
                        prompt_tokens=len(request.prompt_token_ids or []))
            return 0, False
        prefix, start, end = plan
        self._matched[request.request_id] = plan
        return end - start, False

    def _plan(self, request, computed: int):
        """(reason, None) for a fallback, or (None, (stored prefix, start, end))."""
        if self.refusal is not None:
            return f"consumer disabled: {self.refusal}", None
        key = self._isolation_key(request)
        if key is None:
            return "no isolation key (require_isolation_key is set)", None
        request_control(getattr(request, "kv_transfer_params", None) or {})  # ConfigError now, not after allocation
        tokens = list(request.prompt_token_ids or [])
        suffix = max(self._request_spec(request).exact_suffix, 1)
        prefix = self.kvstore.longest_prefix(isolation_key=key, source_model=self.source_model, token_ids=tokens,
                                           max_tokens=len(tokens) - suffix)
        if prefix is None:
            return "no stored source KV for this prompt", None
        start, end = load_plan(prompt_tokens=len(tokens), computed_tokens=computed, stored_tokens=prefix.tokens,
                               block_size=self.block_size, exact_suffix=suffix)
        if end <= start:
            return f"stored prefix of {prefix.tokens} tokens adds nothing past {computed} computed", None
        return None, (prefix, start, end)

    def _request_spec(self, request) -> Recompute:
        return request_spec(getattr(request, "kv_transfer_params", None) or {}, base=self.recompute)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if self.is_producer:
            return
        plan = self._matched.pop(request.request_id, None)
        if num_external_tokens == 0 or plan is None:
            return
        prefix, start, end = plan
        block_ids = list(self._kv_cache_manager.get_block_ids(request.request_id)[0])
        mapped_blocks = block_ids[start // self.block_size:end // self.block_size]
        # approximate KV must never be an exact prefix-cache entry: drop the hashes vLLM just gave them
        self._kv_cache_manager.block_pool.evict_blocks(set(mapped_blocks))
        pin = self.kvstore.pin(prefix)
        if pin is None:  # evicted between the match and now: the worker reports the blocks for recompute
            self._event("fallback", request.request_id, reason="stored KV evicted before the load")
        slots = [block_ids[t // self.block_size] * self.block_size + t % self.block_size for t in range(end)]
        control = request_control(getattr(request, "kv_transfer_params", None) or {})  # checked by _plan
        prompt = list(request.prompt_token_ids)
        self._loads.append(LoadJob(request.request_id, str(pin) if pin else "", prompt, start, end, slots,
                                   mapped_blocks, self._request_spec(request), control=control))
        self._load_reports[request.request_id] = {"mapped_tokens": end - start, "prefill_tokens": len(prompt) - end,
                                                  "prompt_tokens": len(prompt), "control": control}
        self._event("hit", request.request_id, start=start, end=end, local_hit_tokens=start,
                    prompt_tokens=len(prompt), stored_tokens=prefix.tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = KVHubConnectorMetadata(loads=self._loads)
        self._loads = []
        if self.is_producer:
            meta.saves = self._saves(scheduler_output)
        return meta

    def _saves(self, out) -> list[SaveJob]:
        for new in out.scheduled_new_reqs:
            request = self._requests.get(new.req_id)
            try:
                key = self._isolation_key(request) if request is not None else None
            except ConfigError as exc:
                self._event("save_failed", new.req_id, reason=f"bad kv_transfer_params: {exc}")
                continue
            if key is None:
                continue
            self._tracked[new.req_id] = _Tracked(key, list(new.prompt_token_ids or []), list(new.block_ids[0]),
                                                 new.num_computed_tokens)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_ids is not None:
                tracked.block_ids = list(new_ids[0])
            elif new_ids is not None:
                tracked.block_ids += list(new_ids[0])
            tracked.computed = cached.num_computed_tokens[i]
        jobs = []
        for req_id, tracked in self._tracked.items():
            done = tracked.computed + out.num_scheduled_tokens.get(req_id, 0)
            n = len(tracked.token_ids)
            if tracked.saved or done < n or n < self.kvstore.chunk_tokens:
                continue
            tracked.saved = True
            if len(tracked.block_ids) * self.block_size < n:  # never index past them inside the scheduler
                self._event("save_failed", req_id, reason=f"{len(tracked.block_ids)} blocks for {n} prompt tokens")
                continue
            slots = [tracked.block_ids[t // self.block_size] * self.block_size + t % self.block_size for t in range(n)]
            jobs.append(SaveJob(req_id, tracked.isolation_key, tracked.token_ids, slots))
        for req_id in out.finished_req_ids:
            self._tracked.pop(req_id, None)
            self._requests.pop(req_id, None)
        return jobs

    def on_new_request(self, request) -> None:
        if self.is_producer:
            self._requests[request.request_id] = request

    def update_connector_output(self, connector_output) -> None:
        """Merge what each load did on the worker into its report.  vLLM calls this after it has freed the
        step's finished requests (a 1-token request finishes in its load step), but before their outputs
        leave the engine: their reports, handed out by request_finished, are updated in place."""
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, KVHubWorkerMetadata):
            for request_id, report in meta.loads.items():
                target = self._load_reports.get(request_id) or self._finishing.get(request_id)
                if target is not None:
                    target.update(report)
        self._finishing.clear()

    def request_finished(self, request, block_ids):
        """The load's report goes back to the client as the response's kv_transfer_params["kvhub"]."""
        self._matched.pop(request.request_id, None)
        self._tracked.pop(request.request_id, None)
        self._requests.pop(request.request_id, None)
        report = self._load_reports.pop(request.request_id, None)
        if report is None:
            return False, None
        self._finishing[request.request_id] = report
        return False, {"kvhub": report}

    # ---- worker side -----------------------------------------------------------------------------
    def start_load_kv(self, forward_context, **kwargs) -> None:
        """Per load: map [start, end), write every layer into the request's blocks, then let the model
        recompute the spec's tokens over them (:mod:`kvhub.serving.engine_pass`), all before vLLM's forward
        pass, which computes [end, n).  Any failure: the blocks are reported for vLLM to prefill, visibly."""
        meta = self._get_connector_metadata()
        self._layers = {_layer_number(name): layer for name, layer in forward_context.no_compile_layers.items()
                        if hasattr(layer, "kv_cache") and _LAYER_NUMBER.search(name)}
        for job in meta.loads:
            try:
                report = self._load_job(job)
            except Exception as exc:  # noqa: BLE001 - a failed load is recomputed by vLLM, visibly
                self._load_errors.update(job.block_ids)
                report = {"fallback": f"{type(exc).__name__}: {exc}"}
                self._event("fallback", job.request_id, reason=f"load failed: {type(exc).__name__}: {exc}")
                log.warning("kvhub: loading request %s failed, vLLM prefills its blocks: %s", job.request_id, exc)
            finally:
                if job.pin:
                    self.kvstore.release(job.pin)
            self._step_reports[job.request_id] = report

    def _load_job(self, job: LoadJob) -> dict:
        if not job.pin:
            raise IncompatibleError("the stored source KV was evicted before it could be pinned")
        mapper = self._control_mapper() if job.control else self.mapper
        device = mapper.device
        keys, values = self.kvstore.read(job.pin, token_ids=job.prompt_ids[:job.end], start=job.start, end=job.end,
                                       device=device)
        source = mapper.source
        if len(keys) != source["num_layers"] or keys[0].shape[1:] != (source["num_kv_heads"], job.end - job.start,
                                                                       source["head_dim"]):
            raise IncompatibleError(f"stored KV of shape {len(keys)} x {tuple(keys[0].shape)} is not "
                                    f"{source['model_id']}'s; check source_model on both engines")
        positions = torch.arange(job.start, job.end, device=device).unsqueeze(0)  # (1, T): absolute positions
        dtype = next(iter(self._layers.values())).kv_cache.dtype
        mapped = mapper.map_layers(keys, values, positions, dtype=dtype)
        if not all(bool(torch.isfinite(k).all() and torch.isfinite(v).all()) for k, v in mapped):
            raise IncompatibleError("the mapped KV holds Inf/NaN (damaged stored KV or mapper); not written")
        slots = torch.tensor(job.slots[job.start:], dtype=torch.long)
        for m, (k, v) in enumerate(mapped):  # k, v: (1, H, T, D)
            self._write(m, k[0].transpose(0, 1), v[0].transpose(0, 1), slots)
        self._event("mapped", job.request_id, tokens=job.end - job.start, control=job.control)
        self._event("written", job.request_id, layers=len(mapped))
        tokens = len(job.prompt_ids)
        none = torch.empty(0, dtype=torch.long)  # mapped only: the engine computes the tail [end, n) alone
        report = {"mapped_tokens": job.end - job.start, "deshrink": self.mapper.deshrink,
                  **load_counts(none, exact_positions(none, end=job.end, tokens=tokens), tokens=tokens)}
        spec = job.recompute.capped(tokens - 1)
        if not (spec.exact_prefix > job.start or spec.selective):
            return report
        if self.engine is None:
            self._event("recompute_skipped", job.request_id,
                        reason=f"no model attached: run the engine with --worker-cls {WORKER_CLASS}")
            return {**report, "recompute_skipped": "no model attached"}
        return {**report, **self._recompute_job(job, spec)}

    def _write(self, number: int, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        """Write (N, H, D) keys and values of layer ``number`` at ``slots`` (N,) with the backend's writer."""
        layer = self._layers[number]
        device = layer.kv_cache.device
        layer.impl.do_kv_cache_update(layer, keys.to(device, layer.kv_cache.dtype).contiguous(),
                                      values.to(device, layer.kv_cache.dtype).contiguous(), layer.kv_cache,
                                      slots.to(device))

    def _recompute_job(self, job: LoadJob, spec: Recompute) -> dict:
        from kvhub.serving.engine_pass import recompute_request

        started = time.perf_counter()
        context_slots = torch.tensor(job.slots, dtype=torch.long)
        cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def cached(number: int) -> tuple[torch.Tensor, torch.Tensor]:  # (H, end, D) each, read once per load
            if number not in cache:
                layer = self._layers[number]
                slots = context_slots.to(layer.kv_cache.device)
                cache[number] = self._layout(layer, layer.kv_cache).gather(layer.kv_cache, slots)
            return cache[number]

        done = recompute_request(self.engine, spec, prompt_ids=job.prompt_ids, start=job.start, end=job.end,
                                 cached=cached, tokenizer=self._span_tokenizer())
        slots = context_slots[done.positions]
        for number, (keys, values) in enumerate(done.fresh):
            if not bool(torch.isfinite(keys).all() and torch.isfinite(values).all()):
                raise IncompatibleError(f"the recomputed KV of layer {number} holds Inf/NaN; not written")
            self._write(number, keys, values, slots)
        tokens = len(job.prompt_ids)
        report = {"exact_prefix_tokens": done.prefix, "selected_tokens": done.selected,
                  "prefill_tokens": tokens - job.end, **load_counts(done.positions, done.exact, tokens=tokens),
                  "recompute_s": round(time.perf_counter() - started, 4), "recompute": spec.name()}
        self._event("recomputed", job.request_id, **report)
        return report

    def _span_tokenizer(self):
        if self._tokenizer is False:  # not loaded yet
            self._tokenizer = span_tokenizer(self.tokenizer_name)
        return self._tokenizer

    def build_connector_worker_meta(self):
        reports, self._step_reports = self._step_reports, {}
        return KVHubWorkerMetadata(reports) if reports else None

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: start_load_kv wrote every layer (the recompute needs them all first)."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs) -> None:
        if not self.is_producer:
            return
        meta = self._get_connector_metadata()
        if not meta.saves:
            return
        from vllm.forward_context import get_forward_context

        try:
            layer = get_forward_context().no_compile_layers[layer_name]
            layout = self._layout(layer, kv_layer)
            number = _layer_number(layer_name)
        except Exception as exc:  # noqa: BLE001 - a failed save only costs a later cache miss
            for job in meta.saves:
                self._collected.setdefault(job.request_id, {})["error"] = f"{type(exc).__name__}: {exc}"
            return
        for job in meta.saves:
            slots = torch.tensor(job.slots, dtype=torch.long, device=kv_layer.device)
            self._collected.setdefault(job.request_id, {})[number] = layout.gather(kv_layer, slots)

    def _layout(self, layer, kv_layer: torch.Tensor) -> PagedLayout:
        key = (type(layer.impl), getattr(layer, "isa", None), kv_layer.dtype, tuple(kv_layer.shape[1:]))
        if key not in self._layouts:
            self._layouts[key] = layer_layout(layer, kv_layer, block_size=self.block_size)
        return self._layouts[key]

    def wait_for_save(self) -> None:
        if not self.is_producer:
            return
        meta = self._get_connector_metadata()
        for job in meta.saves:
            layers = self._collected.pop(job.request_id, {})
            try:
                if "error" in layers:
                    raise UnsupportedModelError(layers["error"])
                ordered = [layers[l] for l in range(len(layers))]
                self.kvstore.put(isolation_key=job.isolation_key, source_model=self.source_model,
                               token_ids=job.token_ids, keys=[k for k, _ in ordered], values=[v for _, v in ordered])
                self._event("saved", job.request_id, tokens=len(job.token_ids))
            except Exception as exc:  # noqa: BLE001 - a failed save only costs a later cache miss
                self._event("save_failed", job.request_id, reason=f"{type(exc).__name__}: {exc}")
                log.warning("kvhub: saving request %s failed: %s", job.request_id, exc)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors


def _layer_number(layer_name: str) -> int:
    match = _LAYER_NUMBER.search(layer_name)
    if match is None:
        raise IncompatibleError(f"cannot tell the layer number of attention layer {layer_name!r}")
    return int(match.group(1))
