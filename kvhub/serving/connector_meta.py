"""What the two sides of :class:`kvhub.serving.vllm_connector.KVHubConnector` tell each other each engine step.

vLLM runs a connector twice in a consumer or producer engine: the scheduler side decides, the worker
side executes.  The decision is made once, on the scheduler side, into one typed object per step
(:class:`KVHubConnectorMetadata`: the prompts to save, the loads to map), and the worker side reads only
that object; what each load did comes back in :class:`KVHubWorkerMetadata` and ends up in the response's
``kv_transfer_params["kvhub"]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvhub.serving.spec import Recompute


@dataclass
class SaveJob:
    """Producer: a fully computed prompt whose K/V the worker reads from ``slots`` and puts in the KV store."""

    request_id: str
    isolation_key: str
    token_ids: list[int]
    slots: list[int]


@dataclass
class LoadJob:
    """Consumer: map the stored source rows [start, end) into the request's blocks, then recompute ``recompute``'s
    tokens; ``pin`` keeps the stored entry readable until the load is done ("" if it was evicted first)."""

    request_id: str
    pin: str
    prompt_ids: list[int]  # the whole prompt: the recompute's selection pass reads its tail
    start: int
    end: int
    slots: list[int]  # of tokens [0, end): the mapped ones are [start, end)
    block_ids: list[int]  # the blocks of [start, end) (reported back on a failed load)
    recompute: Recompute
    control: bool = False  # map with the no-information control map (kvhub.core.control) instead


@dataclass
class KVHubConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, per engine step."""

    saves: list[SaveJob] = field(default_factory=list)
    loads: list[LoadJob] = field(default_factory=list)


@dataclass
class KVHubWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, per engine step: what each load did ({request id: {"recomputed_tokens": ...}})."""

    loads: dict[str, dict] = field(default_factory=dict)

    def aggregate(self, other: "KVHubWorkerMetadata") -> "KVHubWorkerMetadata":
        return KVHubWorkerMetadata({**self.loads, **other.loads})
