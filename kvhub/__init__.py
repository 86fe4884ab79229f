"""kvhub: fit, version, publish and load linear KV-cache mappers between models of one family.

    mapper = kvhub.load(src, dst, calib="legal-docs")
    target_cache = mapper.transfer(source_cache)

Heavy modules (torch, transformers, sqlalchemy) load on first use; ``import kvhub`` stays cheap.
"""

__version__ = "0.1.0"

_LAZY = {
    "Mapper": ("kvhub.mapper", "Mapper"),
    "fit": ("kvhub.fit", "fit"),
    "load": ("kvhub.api", "load"),
    "handoff": ("kvhub.handoff", "handoff"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'kvhub' has no attribute {name!r}")
