"""A model a fit loads when it first needs it and drops when it is done with it.

A :class:`kvhub.fitting.prepared.PreparedFit` holds a loaded model or a :class:`ModelHandle` for each side.
A handle knows the model's config, dtype and device without its weights (what fingerprints, layouts and
the plan read), loads the weights on :meth:`ModelHandle.get` and lets them go on :meth:`ModelHandle.release`,
so a two-phase fit (:mod:`kvhub.fitting.phases`) holds the source, then the target, never both.
:func:`loaded`, :func:`release` and :func:`device_of` take either form.
"""

from __future__ import annotations

import gc
import logging
from typing import Callable

import torch

from kvhub.errors import IncompatibleError

log = logging.getLogger(__name__)


class ModelHandle:
    """``load()`` -> model, called once on the first :meth:`get`; ``config``, ``dtype`` and ``device`` are
    what the loaded model will have (checked when it loads)."""

    def __init__(self, load: Callable[[], object], *, config, dtype: torch.dtype, device, name: str = "model"):
        self._load = load
        self._model = None
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.name = name
        self.loads = 0  # how often the weights were loaded (a fit loads each side once)

    @property
    def is_loaded(self) -> bool:
        return self._model is not None

    def get(self):
        if self._model is None:
            log.info("loading %s", self.name)
            model = self._load()
            parameter = next(model.parameters())
            if parameter.dtype != self.dtype or parameter.device.type != self.device.type:
                raise IncompatibleError(
                    f"{self.name} loaded as {parameter.dtype} on {parameter.device}, not the {self.dtype} on "
                    f"{self.device} its fingerprint was taken with; pass the dtype explicitly (--dtype)"
                )
            self._model, self.loads = model, self.loads + 1
        return self._model

    @classmethod
    def holding(cls, model, load: Callable[[], object], *, name: str = "model") -> "ModelHandle":
        """A handle over ``model``, already loaded (``load`` brings it back after a release)."""
        handle = cls(load, config=model.config, dtype=model.dtype, device=next(model.parameters()).device, name=name)
        handle._model, handle.loads = model, 1
        return handle

    def release(self) -> None:
        """Drop the weights (a later :meth:`get` loads them again) and give their memory back."""
        if self._model is None:
            return
        self._model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        _trim_host_heap()


def _trim_host_heap() -> None:
    """Hand the host heap's free pages back to the system (glibc keeps what a model's loading freed), so the
    next model loads into them rather than beside them; a no-op where there is no glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:
        return

    def parameters(self):
        """The loaded model's parameters (loading it): what code written for a model asks."""
        return self.get().parameters()


def loaded(model):
    """The model itself: ``model``, or what the handle loads."""
    return model.get() if isinstance(model, ModelHandle) else model


def release(model) -> None:
    """Let a handle's weights go (a plain model is the caller's and stays)."""
    if isinstance(model, ModelHandle):
        model.release()


def device_of(model) -> torch.device:
    return model.device if isinstance(model, ModelHandle) else next(model.parameters()).device


def loaded_bytes(model) -> int:
    """Bytes of weights resident now (a handle not loaded: 0)."""
    if isinstance(model, ModelHandle) and not model.is_loaded:
        return 0
    return sum(p.numel() * p.element_size() for p in loaded(model).parameters())


def lazy_model(spec: str, *, device=None, dtype=None):
    """``(handle, tokenizer, model_id)`` for the model ``spec`` (as :func:`kvhub.models.loading.load_model`
    takes it), its weights not read until the fit asks; a .gguf file or a Hub id, or no dtype to load in,
    loads now (the handle holds it)."""
    from kvhub.dtypes import parse_dtype
    from kvhub.models.loading import describe_model, load_model

    def load():
        return load_model(spec, device=device, dtype=dtype)[0]

    described = describe_model(spec) if dtype is not None else None
    if described is None:
        model, tokenizer, model_id = load_model(spec, device=device, dtype=dtype)
        return ModelHandle.holding(model, load, name=model_id), tokenizer, model_id
    config, tokenizer, model_id = described
    where = device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    return ModelHandle(load, config=config, dtype=parse_dtype(dtype), device=where, name=model_id), tokenizer, model_id
