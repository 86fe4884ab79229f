"""Using a mapper at generation time: the handoff from source to target (:mod:`kvhub.serving.handoff`)
with the selective exact recompute (:mod:`kvhub.serving.recompute`), and the vLLM KV connector
(:mod:`kvhub.serving.vllm_connector`) over a shared, bounded KV store (:mod:`kvhub.serving.kvstore`).
See docs/serving.md.

Importing this package does not import vLLM; only the connector module does.
"""

from kvhub.serving.kvstore import KVStore, StoredPrefix

__all__ = ["KVStore", "StoredPrefix"]
