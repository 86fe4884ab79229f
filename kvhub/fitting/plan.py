"""What a fit costs, from the two configs alone: memory per rank, FLOPs, time, artifact size, mode.
The configs are read and reduced to :class:`kvhub.fitting.shapes.ModelShape` by :mod:`kvhub.fitting.shapes`.

Shapes (``ds``/``dt``: KV width Hkv*D of one source/target layer; ``p = Ls*ds``, ``q = Lt*dt``; a rank
of R owns ``qr = ceil(Lt/R)*dt`` target columns; ``Nr = B*ceil(T/s)`` rows per batch of B sequences
of T tokens at stride s; all sizes in bytes).  Per rank, on the device (the GPU, or the CPU's RAM):

    weights     (P_src + P_dst) * bytes(dtype)                   both models on every rank
    activations B*T*L*2*d*bytes(dtype)     the larger model's cache (L, d: its layers and KV width)
              + B*T*(4*h + 3*i)*bytes(dtype)  hidden/MLP transients of one layer
              + Nr*(p + q)*2*4             the captured fp32 rows of both models, K and V
    exchange    2 * R*Nr*(2p + 2q + 1)*4   a step's rows from every rank (padded and gathered); 0 if R = 1

and in host memory, where kvhub.fitting.fit keeps the statistics and solves:

    statistics  the accumulators of the mode (kvhub.fitting.modes: one pass 2*2*8*(p + p^2 + p*qr + 2*qr)
                in fp64; two passes the larger of pass 1's and pass 2's), exactly what KVStats allocates
    update      Nr*(p + q)*(8 + 8 + 4) + p*CHUNK*(4 + 8)   one batch's fp64/centred/fp32 rows and one
                                                            product chunk (kvhub.core.stats)
    solve       8 * max(3*ds^2 + 2*ds*qr,  3*kd^2 + 3*kd*dt),  kd = k*ds
                (the probe's one-layer ridge against all owned targets; one layer's k-source ridge)
    samples     --map mlp only: 4*2*(p + q) * (min(Rt, c) + min(Rh, c))   the rows kept to train the MLPs
                (kvhub.fitting.samples; Rt, Rh: each split's rows, c: --mlp-tokens), held to the end

    device peak = weights + activations + exchange,  host peak = statistics + samples + max(update, solve)

On a CPU both are one pool that the R ranks share; on GPUs each rank has its device, and the ranks
of one node (up to ``devices_per_host``) share its host memory.

Parameters P count the embedding, the LM head when untied, q/k/v/o (with biases for Qwen2-style
attention), the gated MLP and the norms.  Forward FLOPs of one sequence (the capture runs the
model body, no LM head) are 2*T*(matmul parameters) + 4*L*H*D*T^2 (QK^T and AV over the full T x T
score matrix, as eager and SDPA-math attention compute it).  The statistics cost 4*Nr*(p^2 + p*qr)
FLOPs per batch (K and V; two passes: 4*Nr*(p*ds + p*qr) then 4*Nr*((c*ds)^2 + c*ds*qr)).  Times
divide FLOPs by a :class:`DeviceProfile`'s nominal rates times an efficiency; they are estimates, to
be checked against ``benchmarks/gpu_scale.py``.  Two passes run the forward passes (and the exchange)
twice.  The forward passes run at the rate of the workload's dtype (:meth:`DeviceProfile.forward_rate`):
bf16 (float16 costed alike) or float32; a CPU that emulates bf16 (:func:`kvhub.dtypes.cpu_native_bf16`)
has a bf16 rate a third of its float32 one.

The statistics and the solve run on the host's cores (shared by the node's ranks), the
forward passes on the device.

Modes: ``full`` (one rank holds everything) or ``sharded`` (R ranks; each holds the source Gram and
its target layers' cross blocks and solves those layers; see :mod:`kvhub.fitting.distributed`), and
the statistics mode (:class:`kvhub.fitting.modes.StatisticsMode`), decided here for ``kvhub plan``
and ``kvhub fit`` alike (:func:`plan_fit`), first that fits of: one pass with fp64 totals; one pass
with fp32 totals (every source layer still a candidate, one capture pass); two passes
(:mod:`kvhub.fitting.two_pass`) keeping the most candidate source layers c that fit, fp64 unless fp32
totals keep more.  When none fits, the advice says what would (more ranks, another device).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import asdict, dataclass

from kvhub.calib.recipe import Sequences
from kvhub.core.stats import CHUNK_COLUMNS
from kvhub.dtypes import canonical_name
from kvhub.errors import ConfigError
from kvhub.fitting.devices import (  # noqa: F401 - the profiles stay importable from here
    CPU_BF16_EMULATED,
    CPU_BF16_NATIVE,
    CPU_FP32_FORWARD,
    DEVICES,
    DeviceProfile,
    device_profile,
)
from kvhub.fitting.shapes import ModelShape, load_config, shape_of, shipped_configs  # noqa: F401 (the plan's API)
from kvhub.fitting.modes import (  # noqa: F401 - pass_bytes, statistics_bytes: the formula, for callers of the plan
    ACCUMULATORS,
    MODES,
    ONE_PASS,
    StatisticsMode,
    pass_bytes,
    statistics_bytes,
)

GIB = 1024**3
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
RANK_CHOICES = (1, 2, 4, 8, 16, 32, 64)
FORWARD_EFFICIENCY = 0.4  # share of the nominal rate (bf16 or fp32) a forward pass reaches
MATMUL_EFFICIENCY = 0.7  # share of the nominal fp32/fp64 rate the statistics and the solve reach


# ---- the plan ------------------------------------------------------------------------------------
_SEQUENCES = Sequences()


@dataclass
class Workload:
    """Calibration sizes of a fit (defaults: those of kvhub.calib.recipe.Sequences, the built-in recipes')."""

    samples: int = _SEQUENCES.samples
    heldout: int = _SEQUENCES.heldout_samples
    seq_len: int = _SEQUENCES.seq_len
    stride: int = _SEQUENCES.stride
    batch_size: int = 4
    k: int | None = None  # None: 'auto' (costs are for the largest k of the grid)
    dtype: str = "bfloat16"
    mlp_tokens: int = 0  # --map mlp: rows kept per split for the MLPs (--mlp-tokens); 0: a ridge fit keeps none

    @property
    def rows(self) -> int:
        """Statistics rows of the whole calibration set (train + held-out)."""
        return (self.samples + self.heldout) * math.ceil(self.seq_len / self.stride)


@dataclass
class Plan:
    source: ModelShape
    target: ModelShape
    workload: Workload
    device: DeviceProfile
    ranks: int
    mode: str  # "full" (one rank) or "sharded" (target layers split over the ranks)
    statistics: StatisticsMode  # one or two passes (kvhub.fitting.modes)
    k: int  # the largest k the solve may choose (costs are for it)
    memory: dict[str, int]  # per rank: weights, statistics (the larger pass), activations, solve, peak
    artifact_bytes: int
    flops: dict[str, float]  # whole job: forward, statistics (per rank), solve (per rank)
    exchange_bytes: int  # received by one rank over the fit
    seconds: dict[str, float]
    fits: bool
    advice: str

    def to_dict(self) -> dict:
        out = asdict(self)
        out["source"], out["target"] = self.source.model_id, self.target.model_id
        out["device"] = asdict(self.device)
        return out


def workload_for(
    *,
    samples: int | None = None,
    heldout: int | None = None,
    seq_len: int | None = None,
    stride: int | None = None,
    batch_size: int = 4,
    k: int | None = None,
    dtype: str = "bfloat16",
    mlp_tokens: int = 0,
) -> Workload:
    """A Workload; what is left None takes the calibration recipes' defaults (kvhub.calib.recipe)."""
    from kvhub.calib.recipe import Sequences, heldout_count

    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ConfigError(f"k must be a positive integer or None ('auto'), not {k!r}")
    defaults = Sequences()
    samples = samples or defaults.samples
    return Workload(
        samples=samples,
        heldout=heldout if heldout is not None else heldout_count(samples, defaults.heldout_fraction),
        seq_len=seq_len or defaults.seq_len,
        stride=stride or defaults.stride,
        batch_size=batch_size,
        k=k,
        dtype=dtype,
        mlp_tokens=mlp_tokens,
    )


def _k_for(source: ModelShape, workload: Workload) -> int:
    """The fit's k, or under 'auto' the largest k of the grid the source layers and the rows allow."""
    from kvhub.core.solve import TOP_K_GRID

    if workload.k is not None:
        return workload.k
    train_rows = workload.samples * math.ceil(workload.seq_len / workload.stride)
    feasible = [k for k in TOP_K_GRID if k <= source.layers and k * source.kv_width < train_rows]
    return max(feasible, default=1)


def too_few_observations(source: ModelShape, workload: Workload) -> str | None:
    """Why the solve would refuse this workload before any forward pass could change it, or None.

    A ridge fit needs more training rows, samples * ceil(seq_len / stride), than features, k times the
    source's KV width (under 'auto' the smallest k of the grid, 1); the same rule as
    :func:`kvhub.core.solve.solve`, so a refusal here is one the fit would reach after its forward passes."""
    per_sequence = math.ceil(workload.seq_len / workload.stride)
    rows, k = workload.samples * per_sequence, workload.k or 1
    features = k * source.kv_width
    if features < rows:
        return None
    needed = features // per_sequence + 1
    what = f"k {k} x {source.kv_width}" if workload.k else f"{source.kv_width}"
    return (
        f"{workload.samples} sequences of {workload.seq_len} tokens at stride {workload.stride} give {rows} "
        f"training observations, but a ridge fit needs more than its {features} features ({what}, the KV "
        f"width of {source.model_id}); use --samples {needed} or more, a longer --seq-len or a smaller --stride"
        + (", or a smaller --k" if workload.k and workload.k > 1 else "")
    )


def _solve_costs(
    source: ModelShape, target: ModelShape, k: int, owned_layers: int, auto: bool, solved_layers: int
) -> tuple[int, float]:
    """(transient bytes, FLOPs) of one rank's solve, K and V: the probe (one ridge per source layer against
    the owned targets, scored per pair; over ``solved_layers`` source layers again in a two-pass fit's
    solve) plus each owned layer's coordinate search (kvhub.core.solve._solve_layer: every lambda at k=4,
    every k once, every lambda again at the best k, costed as k = ``k``).
    One ridge of kd = k*ds inputs and dt outputs: kd^3/3 (Cholesky) + 2 kd^2 dt (solve) + 2 kd^2 dt (scoring)."""
    from kvhub.core.solve import DEFAULT_TOP_K, LAMBDA_GRID, TOP_K_GRID

    ds, dt = source.kv_width, target.kv_width
    q_owned, kd = owned_layers * dt, k * ds
    memory = 8 * max(3 * ds * ds + 2 * ds * q_owned, 3 * kd * kd + 3 * kd * dt)
    ridge = lambda inputs: inputs**3 / 3 + 4 * inputs * inputs * dt  # noqa: E731
    probed = source.layers + (solved_layers if solved_layers < source.layers else 0)
    probe = probed * (ds**3 / 3 + 4 * ds * ds * q_owned)
    if auto:
        grid = [c for c in TOP_K_GRID if c <= k]
        per_layer = (
            len(LAMBDA_GRID) * ridge(min(DEFAULT_TOP_K, k) * ds)
            + sum(ridge(c * ds) for c in grid)
            + len(LAMBDA_GRID) * ridge(kd)
        )
    else:
        per_layer = ridge(kd)
    return memory, 2 * (probe + owned_layers * per_layer)


def plan_fit(
    source: ModelShape,
    target: ModelShape,
    workload: Workload,
    device: DeviceProfile,
    *,
    ranks: int = 1,
    statistics: str | StatisticsMode = "auto",
    candidates: int | None = None,
) -> Plan:
    """The plan of a fit on ``ranks`` ranks of ``device`` (see the module docstring for every formula).

    ``statistics``: "auto" (one pass when it fits, else two passes when they fit), "one-pass",
    "two-pass", or a given :class:`StatisticsMode`; ``candidates`` fixes a two-pass fit's candidate
    source layers (default: the most that fit).  This is the one place that decides a fit's mode.
    """
    plan = _choose(source, target, workload, device, ranks, statistics, candidates)
    plan.advice = _advice(plan)
    return plan


def _choose(source, target, workload, device, ranks, statistics, candidates) -> Plan:
    """The plan of the mode to run (module docstring, "Modes"); advice left empty."""
    if isinstance(statistics, StatisticsMode):
        return _estimate(source, target, workload, device, ranks, statistics)
    if statistics not in MODES:
        raise ConfigError(f"statistics mode {statistics!r}: use one of {', '.join(MODES)}")
    if candidates is not None and statistics == "one-pass":
        raise ConfigError("--candidates applies to two-pass statistics; drop it or use --stats two-pass")
    one = _estimate(source, target, workload, device, ranks, ONE_PASS)
    if not one.fits:  # fp32 totals keep the selection over every source layer, and one capture pass
        one32 = _estimate(source, target, workload, device, ranks, StatisticsMode(dtype="float32"))
        one = one32 if one32.fits else one
    if statistics == "one-pass" or (statistics == "auto" and one.fits and candidates is None):
        return one
    two = max(
        (_two_pass(source, target, workload, device, ranks, dtype, candidates) for dtype in ACCUMULATORS),
        key=lambda plan: (plan.fits, plan.statistics.candidates, plan.statistics.dtype == "float64"),
    )
    return two if two.fits or statistics == "two-pass" else one


def _two_pass(source, target, workload, device, ranks, dtype: str, candidates: int | None) -> Plan:
    """The two-pass plan keeping the most candidate source layers that fits (``candidates`` if given), each
    with the largest k (``top_k_max``: a fixed k, else a grid value) that fits; else the one keeping the
    fewest (which does not fit)."""
    from kvhub.core.solve import TOP_K_GRID

    k = _k_for(source, workload)
    owned = math.ceil(target.layers / ranks)
    counts = [candidates] if candidates else range(min(source.layers, owned * k), (workload.k or 1) - 1, -1)
    plan = None
    for count in counts:
        depths = [k] if workload.k else sorted((c for c in TOP_K_GRID if c <= min(k, count)), reverse=True)
        for depth in depths:
            mode = StatisticsMode(passes=2, dtype=dtype, candidates=count, top_k_max=depth)
            plan = _estimate(source, target, workload, device, ranks, mode)
            if plan.fits:
                return plan
    return plan


def _estimate(
    source: ModelShape, target: ModelShape, workload: Workload, device: DeviceProfile, ranks: int, mode: StatisticsMode
) -> Plan:
    if ranks < 1:
        raise ConfigError(f"ranks must be >= 1, got {ranks}")
    dtype = canonical_name(workload.dtype)
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"dtype {workload.dtype!r}: the plan knows model weights in {', '.join(DTYPE_BYTES)}")
    nbytes = DTYPE_BYTES[dtype]
    ds, dt = source.kv_width, target.kv_width
    p, q = source.layers * ds, target.layers * dt
    owned = math.ceil(target.layers / ranks)
    kept = min(source.layers, mode.candidates or source.layers)  # source layers of the solved statistics
    k = min(_k_for(source, workload), mode.top_k_max or source.layers)
    rows_batch = workload.batch_size * math.ceil(workload.seq_len / workload.stride)
    per_sequence = math.ceil(workload.seq_len / workload.stride)
    kept_rows = sum(min(n * per_sequence, workload.mlp_tokens) for n in (workload.samples, workload.heldout))
    big = max((source, target), key=lambda m: m.layers * m.kv_width)
    tokens = workload.batch_size * workload.seq_len
    solve_memory, solve_flops = _solve_costs(source, target, k, owned, workload.k is None, kept)
    passes = pass_bytes(source.layers, ds, owned * dt, mode)
    memory = {
        "weights": (source.parameters() + target.parameters()) * nbytes,
        "activations": (
            tokens * big.layers * 2 * big.kv_width * nbytes
            + tokens * (4 * big.hidden + 3 * big.intermediate) * nbytes
            + rows_batch * (p + q) * 2 * 4
        ),
        "exchange": 2 * ranks * rows_batch * (2 * p + 2 * q + 1) * 4 if ranks > 1 else 0,
        "statistics": max(passes),
        "update": rows_batch * (p + q) * 20 + p * CHUNK_COLUMNS * 12,
        "solve": solve_memory,
        "samples": 4 * 2 * (p + q) * kept_rows,
    }
    if mode.passes == 2:
        memory["statistics_pass1"], memory["statistics_pass2"] = passes
    memory["device_peak"] = memory["weights"] + memory["activations"] + memory["exchange"]
    memory["host_peak"] = memory["statistics"] + memory["samples"] + max(memory["update"], solve_memory)
    memory["peak"] = memory["device_peak"] + memory["host_peak"]
    on_host = min(ranks, device.devices_per_host) if device.gpu else ranks  # ranks sharing one host
    if device.gpu:
        fits = memory["device_peak"] <= device.memory and memory["host_peak"] * on_host <= device.host_memory
        host_fp32, host_fp64 = device.host_fp32 / on_host, device.host_fp64 / on_host
        forward_rate = device.forward_rate(dtype)
    else:
        fits = memory["peak"] * ranks <= device.memory
        host_fp32, host_fp64 = device.fp32 / ranks, device.fp64 / ranks
        forward_rate = device.forward_rate(dtype) / ranks
    sequences = workload.samples + workload.heldout
    forward = (
        mode.passes * sequences * (source.forward_flops(workload.seq_len) + target.forward_flops(workload.seq_len))
    )
    stats_flops = 4 * workload.rows * (p * p + p * owned * dt)
    if mode.passes == 2:
        stats_flops = 4 * workload.rows * (p * ds + p * owned * dt + (kept * ds) ** 2 + kept * ds * owned * dt)
    exchange = mode.passes * (workload.rows * (ranks - 1) // ranks * (2 * p + 2 * q + 1) * 4)
    seconds = {
        "capture": forward / ranks / (forward_rate * FORWARD_EFFICIENCY),
        "statistics": stats_flops / (host_fp32 * MATMUL_EFFICIENCY),
        "exchange": exchange / device.link,
        "solve": solve_flops / (host_fp64 * MATMUL_EFFICIENCY),
    }
    seconds["total"] = sum(seconds.values())
    artifact = target.layers * 2 * (k * ds * dt + dt) * 4 + 2 * q * 4
    return Plan(
        source,
        target,
        workload,
        device,
        ranks,
        "full" if ranks == 1 else "sharded",
        mode,
        k,
        memory,
        artifact,
        {"forward": forward, "statistics": stats_flops, "solve": solve_flops},
        exchange,
        seconds,
        fits,
        "",
    )


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:,.1f} GiB"


def _where(plan: Plan) -> str:
    memory, device = plan.memory, plan.device
    if device.gpu:
        on_host = min(plan.ranks, device.devices_per_host)
        return (
            f"device {_gib(memory['device_peak'])} of {_gib(device.memory)} per rank (weights "
            f"{_gib(memory['weights'])}), host {_gib(memory['host_peak'])} per rank (statistics "
            f"{_gib(memory['statistics'])}) x {on_host} of {_gib(device.host_memory)}"
        )
    return (
        f"{_gib(memory['peak'])} per rank (weights {_gib(memory['weights'])}, statistics "
        f"{_gib(memory['statistics'])}) x {plan.ranks} of {_gib(device.memory)}"
    )


def _advice(plan: Plan) -> str:
    mode = plan.statistics
    if mode.passes == 2:
        one = _estimate(plan.source, plan.target, plan.workload, plan.device, plan.ranks, ONE_PASS)
        passes = (
            f"{mode.describe()}; pass 1 {_gib(plan.memory['statistics_pass1'])}, pass 2 "
            f"{_gib(plan.memory['statistics_pass2'])} of statistics against {_gib(one.memory['statistics'])} "
            "in one pass"
        )
    if plan.fits:
        return f"fits: {_where(plan)}" + (f"; {passes}" if mode.passes == 2 else "")
    text = f"does not fit: {_where(plan)}" + (f" ({passes})" if mode.passes == 2 else "")
    choices = [r for r in RANK_CHOICES if plan.ranks < r <= plan.target.layers]
    for statistics in ("one-pass", "two-pass"):
        for ranks in choices:
            other = _choose(plan.source, plan.target, plan.workload, plan.device, ranks, statistics, None)
            if other.fits:
                how = "" if statistics == "one-pass" else f" with two-pass statistics ({other.statistics.describe()})"
                return text + (
                    f"; run the sharded fit on {ranks} ranks{how}: torchrun --nproc-per-node {ranks} "
                    "-m kvhub fit ... (or kvhub fit --distributed)"
                )
    if mode.passes == 1:
        two = _choose(plan.source, plan.target, plan.workload, plan.device, plan.ranks, "two-pass", None)
        if two.fits:
            return text + f"; two-pass statistics fit ({two.statistics.describe()}): kvhub fit --stats two-pass"
    if plan.device.gpu and plan.memory["device_peak"] > plan.device.memory:
        return text + (
            "; the two models do not fit one device together and kvhub's data-parallel capture puts both "
            "on every rank: use devices with more memory"
        )
    return text + (
        "; no rank count fits, not even with two-pass statistics (pass 1 keeps the whole cross block "
        "of a rank's target layers): use a machine with more memory"
    )


def recommend(
    source: ModelShape,
    target: ModelShape,
    workload: Workload,
    device: DeviceProfile,
    *,
    max_ranks: int = 8,
    statistics: str = "auto",
) -> Plan:
    """The plan with the fewest ranks (up to ``max_ranks``) that fits in one pass, else the fewest that fits
    in two passes (unless ``statistics`` forces one), else the ``max_ranks`` plan (its advice says why)."""
    ranks = [r for r in RANK_CHOICES if r <= max_ranks] or [1]
    kinds = [statistics] if statistics != "auto" else ["one-pass", "two-pass"]
    for kind in kinds:
        for count in ranks:
            plan = plan_fit(source, target, workload, device, ranks=count, statistics=kind)
            if plan.fits:
                return plan
    return plan_fit(source, target, workload, device, ranks=ranks[-1], statistics=statistics)


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
