"""What both sides of the kvhub connector share (:mod:`kvhub.serving.connector_scheduler`,
:mod:`kvhub.serving.connector_worker`): the configuration as read at engine start, the KV store, the mapper
(consumer) and the events they report.

An event is counted (``counters``), logged when it is a fallback, and appended as one JSON line to
``events_path`` when one is set: a fallback is never silent.  No vLLM import.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvhub.serving.connector_config import ConnectorConfig, isolation_key, request_spec
from kvhub.serving.kvstore import KVStore
from kvhub.serving.spec import Recompute

log = logging.getLogger("kvhub.serving")


@dataclass
class ConnectorState:
    """One connector's configuration and shared parts.  ``role_name``: "producer" or "consumer";
    ``config``: ``kv_connector_extra_config`` as read at start, whole (:class:`ConnectorConfig`);
    ``source_model``: the namespace's model (the configured one, else the producer's served model or the
    consumer mapper's source); ``mapper`` / ``refusal``: the consumer's mapper, or why it has none (every
    request then prefills)."""

    role_name: str
    block_size: int
    config: ConnectorConfig
    kvstore: KVStore
    source_model: str = ""
    mapper: Any = None
    refusal: str | None = None
    counters: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def is_producer(self) -> bool:
        return self.role_name == "producer"

    @property
    def recompute(self) -> Recompute:
        """The engine's recompute spec (``config.recompute``)."""
        return self.config.recompute

    @property
    def exact_suffix(self) -> int:
        """The engine spec's, at least 1 (vLLM computes the last prompt token itself)."""
        return max(self.recompute.exact_suffix, 1)

    def event(self, event: str, request_id: str, **fields) -> None:
        self.counters[event] += 1
        if event == "fallback":
            log.info(
                "kvhub %s: request %s is prefilled normally: %s (%d fallbacks so far)",
                self.role_name,
                request_id,
                fields.get("reason"),
                self.counters[event],
            )
        if self.config.events_path:
            line = json.dumps(
                {"time": time.time(), "role": self.role_name, "event": event, "request_id": request_id, **fields}
            )
            try:
                with self._lock, open(self.config.events_path, "a") as f:
                    f.write(line + "\n")
            except OSError as exc:  # the events file is a log: losing a line never touches the request
                if not self.counters["events_lost"]:
                    log.warning(
                        "kvhub %s: cannot append to events_path %s (%s); events are lost until it is writable again",
                        self.role_name,
                        self.config.events_path,
                        exc,
                    )
                self.counters["events_lost"] += 1

    def isolation_key(self, request) -> str | None:
        """ConfigError for a request that names its tenant the wrong way (see connector_config.isolation_key)."""
        return isolation_key(
            request, source=self.config.isolation_key_source, required=self.config.require_isolation_key
        )

    def request_spec(self, request) -> Recompute:
        """The request's own recompute spec (``kv_transfer_params["kvhub_recompute"]``) over the engine's."""
        return request_spec(getattr(request, "kv_transfer_params", None) or {}, base=self.recompute)
