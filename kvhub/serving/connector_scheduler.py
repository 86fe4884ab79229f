"""The scheduler side of the kvhub connector: what to save and what to load, decided once per engine step.

* consumer: :meth:`ConnectorScheduler.get_num_new_matched_tokens` reports the longest stored prefix,
  block-aligned, minus the exact suffix vLLM computes itself (:func:`~kvhub.serving.paged.load_plan`);
  :meth:`~ConnectorScheduler.update_state_after_alloc` pins the stored entry, evicts the mapped blocks from
  vLLM's prefix cache (approximate KV is never an exact prefix) and queues a
  :class:`~kvhub.serving.connector_meta.LoadJob`; a prompt shorter than ``min_escalation_tokens`` loads
  nothing (vLLM prefills it) and its response says ``fallback: "prefill"``;
* producer: :meth:`~ConnectorScheduler.build_connector_meta` tracks each request's blocks and queues a
  :class:`~kvhub.serving.connector_meta.SaveJob` once its prompt is fully computed;
* both: what a load did (the worker's report) goes back to the client in the response's
  ``kv_transfer_params["kvhub"]`` (:meth:`~ConnectorScheduler.request_finished`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvhub.errors import ConfigError
from kvhub.serving.connector_config import request_control, request_prefill
from kvhub.serving.connector_meta import KVHubConnectorMetadata, KVHubWorkerMetadata, LoadJob, SaveJob
from kvhub.serving.connector_state import ConnectorState
from kvhub.serving.paged import load_plan


@dataclass
class _Tracked:
    """Producer bookkeeping of one running request."""

    isolation_key: str
    token_ids: list[int]
    block_ids: list[int]
    computed: int = 0
    saved: bool = False


def prefill_report(reason: str, *, tokens: int, computed: int) -> dict:
    """The response's report for an n-token prompt (``tokens`` = n) the large model prefills by choice, nothing
    loaded: ``fallback: "prefill"`` and why; every context position (n - 1) is its own, ``computed`` of them
    from vLLM's prefix cache."""
    return {
        "fallback": "prefill",
        "reason": reason,
        "prompt_tokens": tokens,
        "mapped_tokens": 0,
        "prefill_tokens": tokens - computed,
        "exact_tokens": max(tokens - 1, 0),
        "exact_fraction": 1.0 if tokens > 1 else 0.0,
    }


# a router's words (semantic-router's kv-transfer-status)
TRANSFER_STATUSES = ("applied", "fallback_reprefill", "unsupported")


def transfer_status(report: dict) -> str:
    """What a load report means to a router: ``applied`` (the mapped KV served the prompt), ``fallback_reprefill``
    (the large model prefilled it itself: by choice, ``fallback: "prefill"``, or after a failed load), or
    ``unsupported`` (this engine maps nothing at all: its consumer was disabled at start, ``unsupported: true``;
    no request of this pair will escalate until the operator fixes it)."""
    if report.get("unsupported"):
        return "unsupported"
    return "fallback_reprefill" if report.get("fallback") else "applied"


class ConnectorScheduler:
    """The scheduler side.  ``kv_cache_manager()``: vLLM's KV cache manager (block ids of a request, the
    block pool), which vLLM gives the connector after it is made."""

    def __init__(self, state: ConnectorState, kv_cache_manager: Callable[[], Any]):
        self.state = state
        self._kv_cache_manager = kv_cache_manager
        self._requests: dict[str, Any] = {}  # producer: request objects, for their isolation keys
        self._tracked: dict[str, _Tracked] = {}
        self._matched: dict[str, tuple[Any, int, int]] = {}  # request id -> (stored prefix, start, end)
        self._loads: list[LoadJob] = []
        self._load_reports: dict[str, dict] = {}  # request id -> what its load did (returned at its end)
        self._finishing: dict[str, dict] = {}  # reports of requests finished this step (update_connector_output)
        # loaded request id -> [index of its first mapped block, index of the first block not yet forgotten]
        self._approximate: dict[str, list[int]] = {}

    # ---- consumer: matching and loading -------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.state.is_producer:
            return 0, False
        try:
            reason, plan = self._plan(request, num_computed_tokens)
        except ConfigError as exc:  # the request's own kvhub_recompute spec
            reason, plan = f"bad kv_transfer_params: {exc}", None
        except Exception as exc:  # noqa: BLE001 - an unreadable KV store is a miss, never a dead scheduler
            reason, plan = f"KV store lookup failed: {type(exc).__name__}: {exc}", None
        if plan is None:
            self.state.event(
                "fallback",
                request.request_id,
                reason=reason,
                local_hit_tokens=num_computed_tokens,
                prompt_tokens=len(request.prompt_token_ids or []),
            )
            return 0, False
        prefix, start, end = plan
        self._matched[request.request_id] = plan
        return end - start, False

    def _plan(self, request, computed: int):
        """(reason, None) for a fallback, or (None, (stored prefix, start, end)).  A prompt shorter than
        ``min_escalation_tokens`` is a fallback before any lookup, and its response says so (:func:`prefill_report`);
        a refused isolation key or bad parameters come first, so their responses still say nothing."""
        state = self.state
        if state.refusal is not None:  # nothing here depends on the request: its response may say so
            reason = f"consumer disabled: {state.refusal}"
            tokens = len(request.prompt_token_ids or [])
            report = {**prefill_report(reason, tokens=tokens, computed=computed), "unsupported": True}
            self._load_reports[request.request_id] = report
            return reason, None
        key = state.isolation_key(request)
        if key is None:
            return "no isolation key (require_isolation_key is set)", None
        params = getattr(request, "kv_transfer_params", None) or {}
        request_control(params)  # ConfigError now, not after allocation
        tokens = list(request.prompt_token_ids or [])
        suffix = max(state.request_spec(request).exact_suffix, 1)
        reason = None
        if request_prefill(params):  # the client settles the conversation: the large model's own KV
            reason = "the request asked for the large model's own prefill (kvhub_prefill)"
        elif len(tokens) < state.config.min_escalation_tokens:  # below break-even: not even looked up
            reason = (
                f"prompt of {len(tokens)} tokens is below min_escalation_tokens={state.config.min_escalation_tokens}"
            )
        if reason is not None:
            self._load_reports[request.request_id] = prefill_report(reason, tokens=len(tokens), computed=computed)
            return reason, None
        prefix = state.kvstore.longest_prefix(
            isolation_key=key, source_model=state.source_model, token_ids=tokens, max_tokens=len(tokens) - suffix
        )
        if prefix is None:
            return "no stored source KV for this prompt", None
        start, end = load_plan(
            prompt_tokens=len(tokens),
            computed_tokens=computed,
            stored_tokens=prefix.tokens,
            block_size=state.block_size,
            exact_suffix=suffix,
        )
        if end <= start:
            return f"stored prefix of {prefix.tokens} tokens adds nothing past {computed} computed", None
        return None, (prefix, start, end)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        state = self.state
        if state.is_producer:
            return
        plan = self._matched.pop(request.request_id, None)
        if num_external_tokens == 0 or plan is None:
            return
        prefix, start, end = plan
        size = state.block_size
        manager = self._kv_cache_manager()
        block_ids = list(manager.get_block_ids(request.request_id)[0])
        mapped_blocks = block_ids[start // size : end // size]
        # approximate KV must never be an exact prefix-cache entry: drop the hashes vLLM just gave them, and
        # those of every later block of the request, computed over them (_forget_approximate)
        manager.block_pool.evict_blocks(set(mapped_blocks))
        self._approximate[request.request_id] = [start // size, end // size]
        pin = state.kvstore.pin(prefix)
        if pin is None:  # evicted between the match and now: the worker reports the blocks for recompute
            state.event("fallback", request.request_id, reason="stored KV evicted before the load")
        slots = [block_ids[t // size] * size + t % size for t in range(end)]
        control = request_control(getattr(request, "kv_transfer_params", None) or {})  # checked by _plan
        prompt = list(request.prompt_token_ids)
        self._loads.append(
            LoadJob(
                request.request_id,
                str(pin) if pin else "",
                prompt,
                start,
                end,
                slots,
                mapped_blocks,
                state.request_spec(request),
                control=control,
            )
        )
        self._load_reports[request.request_id] = {
            "mapped_tokens": end - start,
            "prefill_tokens": len(prompt) - end,
            "prompt_tokens": len(prompt),
            "control": control,
        }
        state.event(
            "hit",
            request.request_id,
            start=start,
            end=end,
            local_hit_tokens=start,
            prompt_tokens=len(prompt),
            stored_tokens=prefix.tokens,
        )

    # ---- both: the step's jobs ----------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output) -> KVHubConnectorMetadata:
        meta = KVHubConnectorMetadata(loads=self._loads)
        self._loads = []
        if self._approximate:
            manager = self._kv_cache_manager()
            for request_id, marks in self._approximate.items():  # the blocks this step filled (vLLM hashed them)
                blocks = manager.get_block_ids(request_id)[0]
                self._forget_approximate(blocks, marks[1])
                marks[1] = max(marks[1], len(blocks) - 1)  # the last block may fill (and be hashed) later
        if self.state.is_producer:
            meta.saves = self._saves(scheduler_output)
        return meta

    # ---- producer: saving ---------------------------------------------------------------------------
    def on_new_request(self, request) -> None:
        if self.state.is_producer:
            self._requests[request.request_id] = request

    def _saves(self, out) -> list[SaveJob]:
        state = self.state
        for new in out.scheduled_new_reqs:
            request = self._requests.get(new.req_id)
            try:
                key = state.isolation_key(request) if request is not None else None
            except ConfigError as exc:
                state.event("save_failed", new.req_id, reason=f"bad kv_transfer_params: {exc}")
                continue
            if key is None:
                continue
            self._tracked[new.req_id] = _Tracked(
                key, list(new.prompt_token_ids or []), list(new.block_ids[0]), new.num_computed_tokens
            )
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
        size = state.block_size
        for req_id, tracked in self._tracked.items():
            done = tracked.computed + out.num_scheduled_tokens.get(req_id, 0)
            n = len(tracked.token_ids)
            if tracked.saved or done < n or n < state.kvstore.chunk_tokens:
                continue
            tracked.saved = True
            if len(tracked.block_ids) * size < n:  # never index past them inside the scheduler
                state.event("save_failed", req_id, reason=f"{len(tracked.block_ids)} blocks for {n} prompt tokens")
                continue
            slots = [tracked.block_ids[t // size] * size + t % size for t in range(n)]
            jobs.append(SaveJob(req_id, tracked.isolation_key, tracked.token_ids, slots))
        for req_id in out.finished_req_ids:
            self._tracked.pop(req_id, None)
            self._requests.pop(req_id, None)
        return jobs

    # ---- both: reports back to the client -----------------------------------------------------------
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
                    if "transfer_status" in target:  # handed out already: a failed load turns it to fallback
                        target["transfer_status"] = transfer_status(target)
        self._finishing.clear()

    def _forget_approximate(self, block_ids, first: int) -> None:
        """Drop the prefix-cache hashes of a loaded request's blocks from its first mapped one on.

        vLLM hashes each block by its tokens (and the cache_salt), whatever computed it, and gives it a hash
        as soon as it is full: the blocks after the mapped ones (the tail vLLM prefilled, the generated tokens)
        hold KV computed over approximate KV.  They cannot be reached while the mapped blocks' hashes are gone,
        but once the same tenant prefills the same prefix exactly (``kvhub_prefill``, an evicted KV store
        entry), its blocks take those hashes again, and vLLM's lookup returns the oldest block of a hash:
        this request's.  So every such block loses its hash in the step that filled it (each step looks only at
        the blocks from the last one it saw) and, all of them once more, when the request finishes."""
        blocks = list(block_ids or [])[first:]
        if blocks:
            self._kv_cache_manager().block_pool.evict_blocks(set(blocks))

    def request_finished(self, request, block_ids):
        """The load's report goes back to the client as the response's kv_transfer_params["kvhub"]; a loaded
        request's blocks leave the prefix cache (:meth:`_forget_approximate`)."""
        marks = self._approximate.pop(request.request_id, None)
        if marks is not None:  # once more from the first mapped block: nothing vLLM hashed in between is left
            self._forget_approximate(block_ids, marks[0])
        self._matched.pop(request.request_id, None)
        self._tracked.pop(request.request_id, None)
        self._requests.pop(request.request_id, None)
        report = self._load_reports.pop(request.request_id, None)
        if report is None:
            return False, None
        report["transfer_status"] = transfer_status(report)
        self._finishing[request.request_id] = report
        return False, {"kvhub": report}
