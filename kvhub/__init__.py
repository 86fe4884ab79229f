"""kvhub: fit, version, publish and load linear KV-cache mappers between models of one family.

    mapper = kvhub.load(src, dst, calib="legal-docs")
    target_cache = mapper.transfer(source_cache)

Heavy modules (torch, transformers, sqlalchemy) load on first use; ``import kvhub`` stays cheap.
The packages follow the flow (docs/architecture.md): ``calib`` -> ``core`` (capture, statistics,
solve, Mapper) -> ``fitting`` -> ``artifact`` / ``store`` -> ``hub`` -> ``api`` (load) ->
``serving`` (handoff, selective recompute, the vLLM connector); ``eval`` measures them.
"""

__version__ = "0.1.0"

_LAZY = {
    "Mapper": ("kvhub.api", "Mapper"),
    "fit": ("kvhub.fitting.fit", "fit"),
    "load": ("kvhub.api", "load"),
    "handoff": ("kvhub.serving.handoff", "handoff"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'kvhub' has no attribute {name!r}")
