"""Dtype names (and device names, :func:`check_device`): the one parser from what a user writes (``bf16``, ``"bfloat16"``, ``"torch.bfloat16"``,
``torch.bfloat16``) to a torch floating-point dtype.

Models, mapped caches and the mapping matmuls all take their dtype through :func:`parse_dtype`, so
every option and argument accepts the same names and refuses the same ones with the same error.
torch is imported when a name is parsed, not when this module is.

Which dtype runs fast here is a device fact too: :func:`cpu_native_bf16` (does this CPU compute bf16
itself, or emulate it: matrix products about 5x, a fit's forward passes about 3x slower than float32) and :func:`default_dtype` (what the forward passes
take when the user names no dtype: ``kvhub fit``, ``eval``, ``bench``, and what ``kvhub plan`` costs).
"""

from __future__ import annotations

from pathlib import Path

from kvhub.errors import ConfigError

CPUINFO = Path("/proc/cpuinfo")
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 AVX-512 BF16 / AMX; Arm's "bf16" feature

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


def cpu_native_bf16(cpuinfo: str | Path | None = None) -> bool | None:
    """Whether this CPU computes bf16 matrix products natively: its flags (``/proc/cpuinfo``, or the file
    ``cpuinfo``) name one of :data:`NATIVE_BF16_FLAGS`.  Elsewhere torch emulates bf16 in float32 units,
    several times slower than float32 itself (an AVX-512 CPU without ``avx512_bf16``, for instance).  None when
    the flags cannot be read (not Linux): unknown, and callers keep bf16."""
    try:
        text = Path(cpuinfo or CPUINFO).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86, Arm
            flags.update(value.split())
    if not flags:
        return None
    return any(flag in flags for flag in NATIVE_BF16_FLAGS)


EMULATED_BF16 = "this CPU emulates bf16 (no avx512_bf16 or amx_bf16 in /proc/cpuinfo)"
EMULATED_BF16_NOTE = f"{EMULATED_BF16}: running in float32, about 3x faster here (--dtype bfloat16 to use bf16 anyway)"


def default_dtype(device: str | None = None) -> tuple[str, str | None]:
    """(dtype name, note) for forward passes on ``device`` when the user names no dtype: ``bfloat16``,
    except on a CPU that emulates it (:func:`cpu_native_bf16` False), where ``float32`` is about 3x faster
    and the note says so in one line (None otherwise).  ``device`` None: cuda if torch sees one, else cpu;
    a name that is no torch device (a ``kvhub plan`` profile: h100, ...) is a GPU."""
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).split(":")[0].lower() != "cpu" or cpu_native_bf16() is not False:
        return "bfloat16", None
    return "float32", EMULATED_BF16_NOTE
