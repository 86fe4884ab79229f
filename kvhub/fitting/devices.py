"""The devices a fit is costed on: nominal capacity and rates of one rank's device and its host
(:class:`DeviceProfile`), the shipped GPU profiles (:data:`DEVICES`) and this machine's (:func:`device_profile`).

Rates are nominal; :mod:`kvhub.fitting.plan` multiplies them by an efficiency.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from kvhub.dtypes import canonical_name, cpu_native_bf16
from kvhub.errors import ConfigError


# CPU forward rates per core.  bf16 with native units (AVX-512 BF16/AMX) is calibrated on the fit of
# docs/benchmarks.md "Fit cost" (the default 0.5B -> 1.5B fit: about 10 min of forward passes on 2 cores);
# emulated bf16 is a sixth of it (ux-4 U4-1: about 1 h for the same fit on an AVX-512 CPU without
# avx512_bf16); float32 half of it (an AVX-512 bf16 dot product does twice the multiply-adds of an fp32 FMA;
# a one-core 512x1536x1536 matmul here: 55 GFLOP/s fp32, 187 bf16, but the forward pass is not all matmul),
# so about 3x the emulated bf16 rate, as `kvhub eval` measured there (2.2x) and the matmul alone (5x) bound it.
CPU_BF16_NATIVE = 285e9
CPU_FP32_FORWARD = CPU_BF16_NATIVE / 2
CPU_BF16_EMULATED = CPU_BF16_NATIVE / 6


@dataclass(frozen=True)
class DeviceProfile:
    """Nominal capacity and rates (FLOP/s, bytes/s) of one rank's device and of the host it sits in.

    A CPU "device" is the whole machine, shared by its ranks (``gpu`` False: host fields unused)."""

    name: str
    memory: int
    bf16: float
    fp32: float
    fp64: float
    link: float  # bytes/s one rank exchanges with the others (NVLink, or gloo over loopback)
    gpu: bool = False
    host_memory: int = 0  # the node's RAM
    host_fp32: float = 0.0  # the node's cores together
    host_fp64: float = 0.0
    devices_per_host: int = 1
    forward_fp32: float = 0.0  # a float32 forward pass's nominal FLOP/s, where it is not ``fp32`` (a CPU's)

    def forward_rate(self, dtype: str) -> float:
        """Nominal FLOP/s of a forward pass in ``dtype``: ``bf16`` for bfloat16 and float16, else the float32 rate."""
        if canonical_name(dtype) in ("bfloat16", "float16"):
            return self.bf16
        return self.forward_fp32 or self.fp32


def _cpu_rates() -> tuple[int, float, float, float]:
    """(RAM bytes, bf16, fp32, fp64 FLOP/s) of this machine; rates per core calibrated on the 2-core
    machine of docs/benchmarks.md "Fit cost" (0.5B -> 1.5B in bf16: forward, statistics and solve).  bf16
    is the native rate, or the emulated one where this CPU has no bf16 units (:func:`cpu_native_bf16`)."""
    cores = os.cpu_count() or 1
    bf16 = CPU_BF16_EMULATED if cpu_native_bf16() is False else CPU_BF16_NATIVE
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), cores * bf16, cores * 40e9, cores * 75e9


def _cpu_profile() -> DeviceProfile:
    memory, bf16, fp32, fp64 = _cpu_rates()
    cores = os.cpu_count() or 1
    return DeviceProfile(
        f"cpu ({cores} cores)", memory, bf16=bf16, fp32=fp32, fp64=fp64, link=2e9, forward_fp32=cores * CPU_FP32_FORWARD
    )


_NODE = {
    "host_memory": 2 * 1024**4,
    "host_fp32": 14e12,
    "host_fp64": 7e12,
    "devices_per_host": 8,
}  # 2 TiB, 2 x 56 cores
DEVICES = {  # memory: what torch.cuda reports as total_memory for the card; host: an 8-GPU node (DGX/HGX)
    "h100": DeviceProfile(
        "NVIDIA H100 80GB SXM", 85_045_608_448, bf16=989e12, fp32=67e12, fp64=67e12, link=450e9, gpu=True, **_NODE
    ),
    "h200": DeviceProfile(
        "NVIDIA H200 141GB SXM", 150_011_871_232, bf16=989e12, fp32=67e12, fp64=67e12, link=450e9, gpu=True, **_NODE
    ),
    "a100": DeviceProfile(
        "NVIDIA A100 80GB SXM", 85_100_000_000, bf16=312e12, fp32=19.5e12, fp64=19.5e12, link=300e9, gpu=True, **_NODE
    ),
}


def device_profile(name: str) -> DeviceProfile:
    """``cpu`` (this machine), ``h100``, ``h200``, ``a100``, or ``cuda`` (the local GPU, matched by name)."""
    key = name.lower()
    if key == "cpu":
        return _cpu_profile()
    if key.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device here; name one of " + ", ".join(["cpu", *DEVICES]))
        props = torch.cuda.get_device_properties(0)
        base = next((d for k, d in DEVICES.items() if k in props.name.lower()), DEVICES["h100"])
        memory, _, fp32, fp64 = _cpu_rates()
        return dataclasses.replace(
            base,
            name=props.name,
            memory=props.total_memory,
            host_memory=memory,
            host_fp32=fp32,
            host_fp64=fp64,
            devices_per_host=torch.cuda.device_count(),
        )
    if key not in DEVICES:
        raise ConfigError(f"unknown device {name!r}; use one of cpu, cuda, " + ", ".join(DEVICES))
    return DEVICES[key]


# ---- this machine --------------------------------------------------------------------------------
def free_memory(device: str) -> int:
    """Bytes free now on ``device``: CUDA's free memory, or the host's MemAvailable."""
    if device.startswith("cuda"):
        import torch

        index = torch.device(device).index
        return torch.cuda.mem_get_info(index if index is not None else torch.cuda.current_device())[0]
    try:  # MemAvailable counts the page cache the kernel would reclaim; free pages alone do not
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def machine_profile(device: str, *, available: int | None = None, loaded: int = 0) -> DeviceProfile:
    """This machine as a :class:`DeviceProfile` whose memory is what is free now on ``device`` (or
    ``available``), plus ``loaded`` bytes already in use by the fit itself (its loaded models)."""
    profile = device_profile("cuda" if device.startswith("cuda") else "cpu")
    memory = (free_memory(device) if available is None else available) + loaded
    host = memory if not profile.gpu else free_memory("cpu")
    return dataclasses.replace(profile, memory=memory, host_memory=host)
