"""Dtype names (and device names, :func:`check_device`): the one parser from what a user writes (``bf16``, ``"bfloat16"``, ``"torch.bfloat16"``,
``torch.bfloat16``) to a torch floating-point dtype.

Models, mapped caches and the mapping matmuls all take their dtype through :func:`parse_dtype`, so
every option and argument accepts the same names and refuses the same ones with the same error.
torch is imported when a name is parsed, not when this module is.
"""

from __future__ import annotations

from kvhub.errors import ConfigError

DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")
_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp64": "float64",
    "double": "float64",
}
_CHOICES = "float32, bfloat16, float16 or float64 (or fp32, bf16, fp16)"


def parse_dtype(dtype):
    """``torch.dtype`` for ``dtype`` (a floating-point torch dtype or one of its names); None stays None.

    Raises :class:`ConfigError` listing the valid names for anything else (``"int8"``, ``"auto"``, a typo).
    """
    if dtype is None:
        return None
    import torch

    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ConfigError(f"dtype {dtype} is not a floating-point type; use {_CHOICES}")
        return dtype
    return getattr(torch, canonical_name(dtype))


def canonical_name(dtype: str) -> str:
    """``"bfloat16"`` for ``"bf16"``, ``"torch.bfloat16"``, ...: the name alone, without importing torch
    (for code that only reasons about sizes, such as the plan).  ConfigError for anything else."""
    name = str(dtype).strip().lower().removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name not in DTYPE_NAMES:
        raise ConfigError(f"unknown dtype {dtype!r}; use {_CHOICES}")
    return name


def dtype_name(dtype) -> str:
    """The name :func:`parse_dtype` reads back (and fingerprints record): torch.bfloat16 -> ``"bfloat16"``."""
    return str(parse_dtype(dtype)).removeprefix("torch.")


def check_device(device, *, what: str = "device") -> None:
    """ConfigError for a ``device`` torch does not know, or a CUDA device this machine does not have, before any
    tensor is placed there (torch's own errors, e.g. pin_memory's, say neither).  ``what``: how the caller
    names the setting in the message (``--device`` on the command line, ``device=`` in Python)."""
    if device is None:
        return
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ConfigError(f"{what} {device!r} is not a device; use cpu, cuda or cuda:N") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"{what} {device}: CUDA is not available here; use "
            + ("--device cpu" if what.startswith("--") else "device='cpu'")
        )
    if parsed.type == "cuda" and (parsed.index or 0) >= torch.cuda.device_count():
        raise ConfigError(
            f"{what} {device}: this machine has {torch.cuda.device_count()} CUDA device(s); use "
            f"cuda:0 .. cuda:{torch.cuda.device_count() - 1}"
        )
