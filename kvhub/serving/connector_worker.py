"""The worker side of the kvhub connector: it executes the step's jobs the scheduler side decided
(:mod:`kvhub.serving.connector_meta`) on the engine's paged KV cache.

* consumer, per :class:`~kvhub.serving.connector_meta.LoadJob` (:meth:`ConnectorWorker.start_load_kv`): read
  the stored source rows [start, end), map them with :meth:`kvhub.core.mapper.Mapper.map_layers` at their
  absolute positions, write every layer into the request's blocks with the attention backend's own writer,
  then let the large model recompute the spec's tokens over them (:mod:`kvhub.serving.engine_pass`), all
  before vLLM's forward pass computes the rest.  Any failure reports the blocks through
  :meth:`~ConnectorWorker.get_block_ids_with_load_errors`, and vLLM prefills them;
* producer, per :class:`~kvhub.serving.connector_meta.SaveJob`: gather the prompt's K/V from every layer
  (:meth:`~ConnectorWorker.save_kv_layer`) and put it in the KV store (:meth:`~ConnectorWorker.wait_for_save`).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from kvhub.errors import IncompatibleError, UnsupportedModelError
from kvhub.serving.connector_config import span_tokenizer
from kvhub.serving.connector_meta import KVHubWorkerMetadata, LoadJob
from kvhub.serving.connector_state import ConnectorState
from kvhub.serving.engine_pass import (
    EnginePass,
    exact_positions,
    load_counts,
    prompt_attention,
    recompute_request,
    stale_source_attention,
)
from kvhub.serving.launch import WORKER_CLASS
from kvhub.serving.paged import PagedLayout, layer_layout
from kvhub.serving.spec import Recompute

log = logging.getLogger("kvhub.serving")

_LAYER_NUMBER = re.compile(r"layers\.(\d+)\.")


class ConnectorWorker:
    """The worker side.  ``metadata()``: this step's jobs (vLLM binds them to the connector before each
    forward pass); ``tokenizer_name``: the served model's tokenizer (recompute spans), None for none."""

    def __init__(self, state: ConnectorState, *, metadata: Callable[[], Any], tokenizer_name: str | None):
        self.state = state
        self._metadata = metadata
        self.tokenizer_name = tokenizer_name
        self._tokenizer: Any = False  # False: not loaded yet; None: none (16-token spans)
        self.engine: EnginePass | None = None  # the recompute's pass over the engine's model (attach_model)
        self._control = None  # the control map, made on the first request that asks for it
        self._layouts: dict[tuple, PagedLayout] = {}
        self._collected: dict[str, dict] = {}  # request id -> {layer: (K, V)} or {"error": why}
        self._layers: dict[int, Any] = {}
        self._load_errors: set[int] = set()
        self._step_reports: dict[str, dict] = {}  # request id -> its load's report, sent with this step's output

    def attach_model(self, model) -> None:
        """Called by :class:`kvhub.serving.vllm_worker.KVHubWorker` once the model is loaded: the consumer's
        recompute runs its decoder layers, and so does the producer's source attention pass (when
        ``source_attention_queries`` > 0).  A model the pass cannot run leaves the consumer mapping only and
        the producer storing KV without attention, visibly."""
        if self.state.is_producer and not self.state.config.source_attention_queries:
            return
        try:
            self.engine = EnginePass(model)
        except UnsupportedModelError as exc:
            what = "stored KV carries no source attention" if self.state.is_producer else "requests are mapped only"
            log.error("kvhub %s: no engine pass for this model, %s: %s", self.state.role_name, what, exc)

    def _control_mapper(self):
        if self._control is None:
            from kvhub.core.control import control_mapper

            self._control = control_mapper(self.state.mapper)
        return self._control

    # ---- consumer: loading --------------------------------------------------------------------------
    def start_load_kv(self, forward_context) -> None:
        """Per load: map [start, end), write every layer into the request's blocks, then let the model
        recompute the spec's tokens over them (:mod:`kvhub.serving.engine_pass`), all before vLLM's forward
        pass, which computes [end, n).  Any failure: the blocks are reported for vLLM to prefill, visibly."""
        meta = self._metadata()
        self._layers = {
            _layer_number(name): layer
            for name, layer in forward_context.no_compile_layers.items()
            if hasattr(layer, "kv_cache") and _LAYER_NUMBER.search(name)
        }
        for job in meta.loads:
            try:
                report = self._load_job(job)
            except Exception as exc:  # noqa: BLE001 - a failed load is recomputed by vLLM, visibly
                self._load_errors.update(job.block_ids)
                report = {"fallback": f"{type(exc).__name__}: {exc}"}
                self.state.event("fallback", job.request_id, reason=f"load failed: {type(exc).__name__}: {exc}")
                log.warning("kvhub: loading request %s failed, vLLM prefills its blocks: %s", job.request_id, exc)
            finally:
                if job.pin:
                    self.state.kvstore.release(job.pin)
            self._step_reports[job.request_id] = report

    def _load_job(self, job: LoadJob) -> dict:
        state = self.state
        if not job.pin:
            raise IncompatibleError("the stored source KV was evicted before it could be pinned")
        mapper = self._control_mapper() if job.control else state.mapper
        device = mapper.device
        began = time.perf_counter()
        keys, values = state.kvstore.read(
            job.pin, token_ids=job.prompt_ids[: job.end], start=job.start, end=job.end, device=device
        )
        source = mapper.source
        if len(keys) != source["num_layers"] or keys[0].shape[1:] != (
            source["num_kv_heads"],
            job.end - job.start,
            source["head_dim"],
        ):
            raise IncompatibleError(
                f"stored KV of shape {len(keys)} x {tuple(keys[0].shape)} is not "
                f"{source['model_id']}'s; check source_model on both engines"
            )
        read = time.perf_counter()
        positions = torch.arange(job.start, job.end, device=device).unsqueeze(0)  # (1, T): absolute positions
        dtype = next(iter(self._layers.values())).kv_cache.dtype
        mapped = mapper.map_layers(keys, values, positions, dtype=dtype)
        if not all(bool(torch.isfinite(k).all() and torch.isfinite(v).all()) for k, v in mapped):
            raise IncompatibleError("the mapped KV holds Inf/NaN (damaged stored KV or mapper); not written")
        done_map = time.perf_counter()
        slots = torch.tensor(job.slots[job.start :], dtype=torch.long)
        for m, (k, v) in enumerate(mapped):  # k, v: (1, H, T, D)
            self._write(m, k[0].transpose(0, 1), v[0].transpose(0, 1), slots)
        timing = {  # where the load's time went before any recompute (seconds)
            "read_s": round(read - began, 4),
            "map_s": round(done_map - read, 4),
            "write_s": round(time.perf_counter() - done_map, 4),
        }
        state.event("mapped", job.request_id, tokens=job.end - job.start, control=job.control)
        state.event("written", job.request_id, layers=len(mapped))
        tokens = len(job.prompt_ids)
        none = torch.empty(0, dtype=torch.long)  # mapped only: the engine computes the tail [end, n) alone
        report = {
            "mapped_tokens": job.end - job.start,
            "deshrink": state.mapper.deshrink,
            **load_counts(none, exact_positions(none, end=job.end, tokens=tokens), tokens=tokens),
            **timing,
        }
        spec = job.recompute.capped(tokens - 1)
        if not (spec.exact_prefix > job.start or spec.selective):
            return report
        if self.engine is None:
            state.event(
                "recompute_skipped",
                job.request_id,
                reason=f"no model attached: run the engine with --worker-cls {WORKER_CLASS}",
            )
            return {**report, "recompute_skipped": "no model attached"}
        return {**report, **self._recompute_job(job, spec)}

    def _write(self, number: int, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        """Write (N, H, D) keys and values of layer ``number`` at ``slots`` (N,) with the backend's writer."""
        layer = self._layers[number]
        device = layer.kv_cache.device
        layer.impl.do_kv_cache_update(
            layer,
            keys.to(device, layer.kv_cache.dtype).contiguous(),
            values.to(device, layer.kv_cache.dtype).contiguous(),
            layer.kv_cache,
            slots.to(device),
        )

    def _recompute_job(self, job: LoadJob, spec: Recompute) -> dict:
        started = time.perf_counter()
        context_slots = torch.tensor(job.slots, dtype=torch.long)
        source_attention, selector_note = None, {}
        if spec.selective and spec.select == "source":
            source_attention = self.state.kvstore.read_attention(
                job.pin, token_ids=job.prompt_ids[: job.end], end=job.end
            )
            why = stale_source_attention(source_attention, prompt_tokens=len(job.prompt_ids), spec=spec)
            if why:  # the large model's own attention instead
                spec, source_attention = replace(spec, select="target"), None
                selector_note = {"select_fallback": f"{why}: select=target"}
                self.state.event("select_fallback", job.request_id, reason=selector_note["select_fallback"])
        cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def cached(number: int) -> tuple[torch.Tensor, torch.Tensor]:  # (H, end, D) each, read once per load
            if number not in cache:
                layer = self._layers[number]
                slots = context_slots.to(layer.kv_cache.device)
                cache[number] = self._layout(layer, layer.kv_cache).gather(layer.kv_cache, slots)
            return cache[number]

        done = recompute_request(
            self.engine,
            spec,
            prompt_ids=job.prompt_ids,
            start=job.start,
            end=job.end,
            cached=cached,
            tokenizer=self._span_tokenizer(),
            source_attention=source_attention,
        )
        slots = context_slots[done.positions]
        for number, (keys, values) in enumerate(done.fresh):
            if not bool(torch.isfinite(keys).all() and torch.isfinite(values).all()):
                raise IncompatibleError(f"the recomputed KV of layer {number} holds Inf/NaN; not written")
            self._write(number, keys, values, slots)
        tokens = len(job.prompt_ids)
        report = {
            "exact_prefix_tokens": done.prefix,
            "selected_tokens": done.selected,
            "prefill_tokens": tokens - job.end,
            **load_counts(done.positions, done.exact, tokens=tokens),
            "recompute_s": round(time.perf_counter() - started, 4),
            **done.profile,
            "recompute": spec.name(),
            **selector_note,
        }
        self.state.event("recomputed", job.request_id, **report)
        return report

    def _span_tokenizer(self):
        if self._tokenizer is False:  # not loaded yet
            self._tokenizer = span_tokenizer(self.tokenizer_name)
        return self._tokenizer

    def build_connector_worker_meta(self):
        reports, self._step_reports = self._step_reports, {}
        return KVHubWorkerMetadata(reports) if reports else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- producer: saving ---------------------------------------------------------------------------
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        if not self.state.is_producer:
            return
        meta = self._metadata()
        if not meta.saves:
            return
        from vllm.forward_context import get_forward_context  # vLLM's, present only inside an engine

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
            self._layouts[key] = layer_layout(layer, kv_layer, block_size=self.state.block_size)
        return self._layouts[key]

    def _prompt_attention(self, request_id: str, token_ids: list[int], layers) -> torch.Tensor | None:
        """The small model's attention of the prompt's last ``source_attention_queries`` tokens on the prompt
        (:func:`kvhub.serving.engine_pass.prompt_attention`), stored with its KV for the consumer's
        ``select=source``; None when off or when the pass fails (the KV is stored all the same, visibly)."""
        queries = self.state.config.source_attention_queries
        if not queries:
            return None
        if self.engine is None:
            _no_attention(request_id, self.state, f"no model attached: run the engine with --worker-cls {WORKER_CLASS}")
            return None
        try:
            return prompt_attention(self.engine, token_ids, lambda number: layers[number], queries=queries)
        except Exception as exc:  # noqa: BLE001 - the KV is still worth storing; the consumer falls back to target
            _no_attention(request_id, self.state, f"{type(exc).__name__}: {exc}")
            return None

    def wait_for_save(self) -> None:
        state = self.state
        if not state.is_producer:
            return
        meta = self._metadata()
        for job in meta.saves:
            layers = self._collected.pop(job.request_id, {})
            try:
                if "error" in layers:
                    raise UnsupportedModelError(layers["error"])
                ordered = [layers[l] for l in range(len(layers))]
                attention = self._prompt_attention(job.request_id, job.token_ids, ordered)
                state.kvstore.put(
                    isolation_key=job.isolation_key,
                    source_model=state.source_model,
                    token_ids=job.token_ids,
                    keys=[k for k, _ in ordered],
                    values=[v for _, v in ordered],
                    attention=attention,
                )
                state.event("saved", job.request_id, tokens=len(job.token_ids), attention=attention is not None)
            except Exception as exc:  # noqa: BLE001 - a failed save only costs a later cache miss
                state.event("save_failed", job.request_id, reason=f"{type(exc).__name__}: {exc}")
                log.warning("kvhub: saving request %s failed: %s", job.request_id, exc)


def _no_attention(request_id: str, state: ConnectorState, why: str) -> None:
    state.event("attention_skipped", request_id, reason=why)
    log.warning("kvhub producer: request %s is stored without source attention: %s", request_id, why)


def _layer_number(layer_name: str) -> int:
    match = _LAYER_NUMBER.search(layer_name)
    if match is None:
        raise IncompatibleError(f"cannot tell the layer number of attention layer {layer_name!r}")
    return int(match.group(1))
