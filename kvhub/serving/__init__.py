"""Using a mapper at generation time: the handoff from source to target (:mod:`kvhub.serving.handoff`)
with the selective exact recompute (:mod:`kvhub.serving.recompute`), and the vLLM KV connector
(:mod:`kvhub.serving.vllm_connector`) over a shared, bounded KV store (:mod:`kvhub.serving.kvstore`).
See docs/serving.md.

Importing this package imports neither vLLM (only the connector module does) nor torch.
"""

# Lazily: the KV store holds torch tensors, and importing kvhub.serving.spec or .launch must not load torch.
_LAZY = {"KVStore": "kvhub.serving.kvstore", "StoredPrefix": "kvhub.serving.kvstore"}

__all__ = ["KVStore", "StoredPrefix"]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
