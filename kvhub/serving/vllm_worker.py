"""The worker class that hands the large model to the kvhub connector (``--worker-cls``).

vLLM gives a KV connector its KV caches but not the model, and the consumer's selective recompute runs
the engine's own decoder layers (:mod:`kvhub.serving.engine_pass`).  vLLM supports a custom worker class
(``--worker-cls`` / ``ParallelConfig.worker_cls``) without touching its files: this one is the platform's
own worker plus one step, after the KV caches and the connector are set up, that calls the connector's
``attach_model`` with the loaded model.  Without it the consumer maps only, and says so on every load
(``kvhub serve`` passes it to the large server).  No second copy of any weight is made.
"""

from __future__ import annotations

import logging

from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
from vllm.platforms import current_platform

if current_platform.is_cpu():
    from vllm.v1.worker.cpu_worker import CPUWorker as _PlatformWorker
else:
    from vllm.v1.worker.gpu_worker import Worker as _PlatformWorker

log = logging.getLogger("kvhub.serving")


class KVHubWorker(_PlatformWorker):
    """The platform's worker; after ``initialize_from_config`` the connector gets the model."""

    def initialize_from_config(self, kv_cache_config) -> None:
        super().initialize_from_config(kv_cache_config)
        if not has_kv_transfer_group():
            return
        connector = get_kv_transfer_group()
        attach = getattr(connector, "attach_model", None)
        if attach is None:
            log.warning(
                "kvhub worker: the configured KV connector %s takes no model; nothing attached",
                type(connector).__name__,
            )
            return
        attach(self.get_model())
