"""Serving integrations: a vLLM KV connector (:mod:`kvhub.serving.vllm_connector`) over a shared,
bounded KV store (:mod:`kvhub.serving.kvstore`).  See docs/serving.md.

Importing this package does not import vLLM; only the connector module does.
"""

from .kvstore import KVStore, StoredPrefix

__all__ = ["KVStore", "StoredPrefix"]
