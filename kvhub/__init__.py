"""kvhub: fit, version, publish and load linear KV-cache mappers between models of one family.

    mapper = kvhub.load(src, dst, calib="legal-docs")
    target_cache = mapper.transfer(source_cache)

Heavy modules (torch, transformers, sqlalchemy) load on first use; ``import kvhub`` stays cheap.
``kvhub.fit`` and ``kvhub.handoff`` are the functions, whatever was imported before: importing the
submodules of the same names (``import kvhub.fit``) does not rebind them (reach a submodule through
``sys.modules`` or ``importlib.import_module("kvhub.fit")``).
"""

import sys
import types

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


class _Package(types.ModuleType):
    """The kvhub package: the import system's binding of a submodule to its parent's attribute is
    skipped for the names of public functions (``kvhub.fit`` stays the function ``kvhub.fit.fit``)."""

    def __setattr__(self, name, value):
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
