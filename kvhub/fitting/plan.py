"""What a fit costs, from the two configs alone: memory per rank, FLOPs, time, artifact size, mode.
The configs are read and reduced to :class:`kvhub.fitting.shapes.ModelShape` by :mod:`kvhub.fitting.shapes`.

Shapes (``ds``/``dt``: KV width Hkv*D of one source/target layer; ``p = Ls*ds``, ``q = Lt*dt``; a rank
of R owns ``qr = ceil(Lt/R)*dt`` target columns; ``Nr = B*ceil(T/s)`` rows per batch of B sequences
of T tokens at stride s; all sizes in bytes).  Per rank, on the device (the GPU, or the CPU's RAM):

    weights     (P_src + P_dst) * bytes(dtype)                   both models on every rank (one-phase capture)
                max(P_src, P_dst) * bytes(dtype)                 one at a time (two-phase capture)
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

and on disk, with two-phase capture (:mod:`kvhub.fitting.phases`), the spool of the source's captures:

    spool       ceil(rows/R) * p * 2 * 4    a rank's kept rows, every source layer's K and V in fp32
                                            (kvhub.fitting.spool), written once and read once per pass;
                                            the ranks of one host share its disk (all R on a CPU)

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

Capture: ``one-phase`` (both models resident, each batch through the source then the target) or
``two-phase`` (the source alone over every batch into the spool, then the target alone: the same
statistics with the larger model's weights only; the source runs once even with two statistics passes).
"auto" takes the first that fits of: one pass fp64 one-phase, two-phase; one pass fp32 one-phase,
two-phase; then two passes (either capture), so what changes no number comes first.

Target layout: ``whole`` (the target on the device) or ``layer-outer`` (:mod:`kvhub.fitting.layer_outer`:
its weights on the host, one decoder layer plus the embedding on the device at a time, every batch's
hidden states carried on the host, the spool read once per target layer; one-pass statistics, two-phase
capture; on R ranks each sweeps its own batches and keeps its target layers, :mod:`kvhub.fitting.rank_phases`).
Per rank: device weights max(P_src, P_embed + P_layer); on the host the target's weights P_dst and its
batches' hidden states (S + H) * T * h * bytes(dtype) / R; the time of moving the target's weights to the
device once (PCIe, :data:`ONLOAD_RATE`), of reading the spool Lt times and of exchanging every sweep's
rows.  "auto" takes it only when no whole-target plan fits.

Modes: ``full`` (one rank holds everything) or ``sharded`` (R ranks; each holds the source Gram and
its target layers' cross blocks and solves those layers; see :mod:`kvhub.fitting.distributed`), and
the statistics mode (:class:`kvhub.fitting.modes.StatisticsMode`), decided here for ``kvhub plan``
and ``kvhub fit`` alike (:func:`plan_fit`), first that fits of: one pass with fp64 totals; one pass
with fp32 totals (every source layer still a candidate, one capture pass); two passes
(:mod:`kvhub.fitting.two_pass`) keeping the most candidate source layers c that fit, fp64 unless fp32
totals keep more.  When none fits, the advice says what would (more ranks, another device).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from kvhub.core.stats import CHUNK_COLUMNS
from kvhub.dtypes import canonical_name
from kvhub.errors import ConfigError
from kvhub.fitting.devices import (  # noqa: F401 - the profiles and this machine's stay importable from here
    CPU_BF16_EMULATED,
    CPU_BF16_NATIVE,
    CPU_FP32_FORWARD,
    DEVICES,
    DeviceProfile,
    device_profile,
    free_memory,
    machine_profile,
)
from kvhub.fitting.workload import Workload, _k_for, _solve_costs, too_few_observations, workload_for  # noqa: F401 (the plan's API)
from kvhub.fitting.shapes import ModelShape, load_config, shape_of, shipped_configs  # noqa: F401 (the plan's API)
from kvhub.fitting.modes import (  # noqa: F401 - pass_bytes, statistics_bytes: the formula, for callers of the plan
    ACCUMULATORS,
    MODES,
    ONE_PASS,
    CAPTURES,
    TARGET_LAYOUTS,
    StatisticsMode,
    pass_bytes,
    statistics_bytes,
)

GIB = 1024**3
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
RANK_CHOICES = (1, 2, 4, 8, 16, 32, 64)
FORWARD_EFFICIENCY = 0.4  # share of the nominal rate (bf16 or fp32) a forward pass reaches
MATMUL_EFFICIENCY = 0.7  # share of the nominal fp32/fp64 rate the statistics and the solve reach
DISK_RATE = 1e9  # bytes/s a spool is written and read at (a conservative NVMe sequential rate)
ONLOAD_RATE = 20e9  # bytes/s host -> device for a layer-outer target's weights (PCIe 4/5 x16, sustained)


# ---- the plan ------------------------------------------------------------------------------------
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
    capture: str = "one-phase"  # or "two-phase" (kvhub.fitting.phases)
    target_layout: str = "whole"  # or "layer-outer" (kvhub.fitting.layer_outer)
    spool_free: int | None = None  # bytes free where the spool goes (None: not checked)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["source"], out["target"] = self.source.model_id, self.target.model_id
        out["device"] = asdict(self.device)
        return out


def plan_fit(
    source: ModelShape,
    target: ModelShape,
    workload: Workload,
    device: DeviceProfile,
    *,
    ranks: int = 1,
    statistics: str | StatisticsMode = "auto",
    candidates: int | None = None,
    capture: str = "one-phase",
    spool_free: int | None = None,
    target_layout: str = "whole",
) -> Plan:
    """The plan of a fit on ``ranks`` ranks of ``device`` (see the module docstring for every formula).

    ``statistics``: "auto" (one pass when it fits, else two passes when they fit), "one-pass",
    "two-pass", or a given :class:`StatisticsMode`; ``candidates`` fixes a two-pass fit's candidate
    source layers (default: the most that fit); ``capture``: "one-phase", "two-phase" or "auto" (module
    docstring, "Capture"); ``spool_free``: bytes free where a two-phase spool goes (None: not checked).
    This is the one place that decides a fit's mode and capture.
    """
    if capture not in CAPTURES:
        raise ConfigError(f"capture {capture!r}: use one of {', '.join(CAPTURES)}")
    if target_layout not in TARGET_LAYOUTS:
        raise ConfigError(f"target layout {target_layout!r}: use one of {', '.join(TARGET_LAYOUTS)}")
    plan = None
    if target_layout != "layer-outer":
        plan = _choose(source, target, workload, device, ranks, statistics, candidates, capture, spool_free)
    if target_layout != "whole" and (plan is None or not plan.fits):
        outer = _layer_outer(source, target, workload, device, ranks, statistics, spool_free)
        plan = outer if plan is None or outer.fits else plan
    plan.advice = _advice(plan)
    return plan


def _choose(
    source, target, workload, device, ranks, statistics, candidates, capture="one-phase", spool_free=None
) -> Plan:
    """The plan of the mode and capture to run (module docstring, "Capture" and "Modes"); advice left empty."""
    captures = ("one-phase", "two-phase") if capture == "auto" else (capture,)
    estimate = lambda mode, phases: _estimate(  # noqa: E731
        source, target, workload, device, ranks, mode, capture=phases, spool_free=spool_free
    )
    if isinstance(statistics, StatisticsMode):
        plans = [estimate(statistics, phases) for phases in captures]
        return next((plan for plan in plans if plan.fits), plans[-1])
    if statistics not in MODES:
        raise ConfigError(f"statistics mode {statistics!r}: use one of {', '.join(MODES)}")
    if candidates is not None and statistics == "one-pass":
        raise ConfigError("--candidates applies to two-pass statistics; drop it or use --stats two-pass")
    # fp32 totals keep the selection over every source layer, and one capture pass
    ones = [estimate(mode, phases) for mode in (ONE_PASS, StatisticsMode(dtype="float32")) for phases in captures]
    one = next((plan for plan in ones if plan.fits), ones[len(captures) - 1])
    if statistics == "one-pass" or (statistics == "auto" and one.fits and candidates is None):
        return one
    two = max(
        (
            _two_pass(source, target, workload, device, ranks, dtype, candidates, phases, spool_free)
            for dtype in ACCUMULATORS
            for phases in captures
        ),
        key=lambda plan: (
            plan.fits,
            plan.statistics.candidates,
            plan.statistics.dtype == "float64",
            plan.capture == "one-phase",
        ),
    )
    return two if two.fits or statistics == "two-pass" else one


def _layer_outer(source, target, workload, device, ranks, statistics, spool_free) -> Plan:
    """The layer-outer plan (module docstring, "Target layout"): one-pass statistics, fp64 totals unless only
    fp32 fit; refused (not fitting) with two-pass statistics asked."""
    modes = [statistics] if isinstance(statistics, StatisticsMode) else [ONE_PASS, StatisticsMode(dtype="float32")]
    kwargs = {"capture": "two-phase", "spool_free": spool_free, "target_layout": "layer-outer"}
    plans = [_estimate(source, target, workload, device, ranks, mode, **kwargs) for mode in modes]
    plan = next((p for p in plans if p.fits), plans[0])
    if plan.statistics.passes == 2 or statistics == "two-pass":
        plan.fits = False
    return plan


def _two_pass(
    source, target, workload, device, ranks, dtype: str, candidates: int | None, capture="one-phase", spool_free=None
) -> Plan:
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
            plan = _estimate(source, target, workload, device, ranks, mode, capture=capture, spool_free=spool_free)
            if plan.fits:
                return plan
    return plan


def _estimate(
    source: ModelShape,
    target: ModelShape,
    workload: Workload,
    device: DeviceProfile,
    ranks: int,
    mode: StatisticsMode,
    *,
    capture: str = "one-phase",
    spool_free: int | None = None,
    target_layout: str = "whole",
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
    two_phase = capture == "two-phase"
    outer = target_layout == "layer-outer"
    on_device = target.parameters() if not outer else target.vocab * target.hidden + target.layer_parameters()
    weights = (max if two_phase else sum)((source.parameters(), on_device)) * nbytes
    memory = {
        "weights": weights,
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
        "spool": math.ceil(workload.rows / ranks) * p * 2 * 4 if two_phase else 0,  # on disk
    }
    if mode.passes == 2:
        memory["statistics_pass1"], memory["statistics_pass2"] = passes
    if outer:  # the target's weights wait on the host; every batch's hidden states are carried there
        memory["target_weights_host"] = target.parameters() * nbytes
        sequences = math.ceil((workload.samples + workload.heldout) / ranks)  # each rank carries its own batches
        memory["hidden_states"] = sequences * workload.seq_len * target.hidden * nbytes
    memory["device_peak"] = memory["weights"] + memory["activations"] + memory["exchange"]
    memory["host_peak"] = (
        memory["statistics"]
        + memory["samples"]
        + max(memory["update"], solve_memory)
        + memory.get("target_weights_host", 0)
        + memory.get("hidden_states", 0)
    )
    memory["peak"] = memory["device_peak"] + memory["host_peak"]
    on_host = min(ranks, device.devices_per_host) if device.gpu else ranks  # ranks sharing one host
    spool_fits = spool_free is None or memory["spool"] * on_host <= spool_free
    if device.gpu:
        fits = memory["device_peak"] <= device.memory and memory["host_peak"] * on_host <= device.host_memory
        host_fp32, host_fp64 = device.host_fp32 / on_host, device.host_fp64 / on_host
        forward_rate = device.forward_rate(dtype)
    else:
        fits = memory["peak"] * ranks <= device.memory
        host_fp32, host_fp64 = device.fp32 / ranks, device.fp64 / ranks
        forward_rate = device.forward_rate(dtype) / ranks
    sequences = workload.samples + workload.heldout
    source_runs = 1 if two_phase else mode.passes  # two phases: the source once, into the spool
    forward = sequences * (
        source_runs * source.forward_flops(workload.seq_len) + mode.passes * target.forward_flops(workload.seq_len)
    )
    stats_flops = 4 * workload.rows * (p * p + p * owned * dt)
    if mode.passes == 2:
        stats_flops = 4 * workload.rows * (p * ds + p * owned * dt + (kept * ds) ** 2 + kept * ds * owned * dt)
    row_bytes = (2 * p + 2 * dt) * 4 * target.layers if outer else (2 * p + 2 * q + 1) * 4 * mode.passes  # per sweep
    exchange = workload.rows * (ranks - 1) // ranks * row_bytes
    seconds = {
        "capture": forward / ranks / (forward_rate * FORWARD_EFFICIENCY),
        "statistics": stats_flops / (host_fp32 * MATMUL_EFFICIENCY),
        "exchange": exchange / device.link,
        "solve": solve_flops / (host_fp64 * MATMUL_EFFICIENCY),
    }
    if two_phase:  # written once, read once per statistics pass (layer-outer: once per target layer)
        reads = target.layers if outer else mode.passes
        seconds["spool"] = memory["spool"] * on_host * (1 + reads) / DISK_RATE
    if outer:
        seconds["onload"] = memory["target_weights_host"] / ONLOAD_RATE
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
        fits and spool_fits,
        "",
        capture=capture,
        spool_free=spool_free if two_phase else None,  # what this machine's disk had free: only where a spool goes
        target_layout=target_layout,
    )


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:,.1f} GiB"


def _where(plan: Plan) -> str:
    memory, device = plan.memory, plan.device
    weights = "weights" if plan.capture == "one-phase" else "weights of one model at a time"
    if plan.target_layout == "layer-outer":
        weights = "weights of the source, or of one target layer and the embedding"
    if device.gpu:
        on_host = min(plan.ranks, device.devices_per_host)
        text = (
            f"device {_gib(memory['device_peak'])} of {_gib(device.memory)} per rank ({weights} "
            f"{_gib(memory['weights'])}), host {_gib(memory['host_peak'])} per rank (statistics "
            f"{_gib(memory['statistics'])}) x {on_host} of {_gib(device.host_memory)}"
        )
        if plan.target_layout == "layer-outer":
            text += (
                f" (the target's weights {_gib(memory['target_weights_host'])} and the hidden states "
                f"{_gib(memory['hidden_states'])} wait on the host)"
            )
    else:
        on_host = plan.ranks
        text = (
            f"{_gib(memory['peak'])} per rank ({weights} {_gib(memory['weights'])}, statistics "
            f"{_gib(memory['statistics'])}) x {plan.ranks} of {_gib(device.memory)}"
        )
    if plan.capture == "two-phase":
        free = "" if plan.spool_free is None else f" of {_gib(plan.spool_free)} free"
        text += f"; spool {_gib(memory['spool'])} per rank x {on_host} on disk{free}"
    return text


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
    again = dict(capture=plan.capture, spool_free=plan.spool_free)
    for statistics in ("one-pass", "two-pass"):
        for ranks in choices:
            other = _choose(plan.source, plan.target, plan.workload, plan.device, ranks, statistics, None, **again)
            if other.fits:
                how = "" if statistics == "one-pass" else f" with two-pass statistics ({other.statistics.describe()})"
                return text + (
                    f"; run the sharded fit on {ranks} ranks{how}: torchrun --nproc-per-node {ranks} "
                    "-m kvhub fit ... (or kvhub fit --distributed)"
                )
    if plan.capture == "one-phase":
        phased = _choose(plan.source, plan.target, plan.workload, plan.device, plan.ranks, mode, None, "two-phase")
        if phased.fits:
            return text + "; with one model resident at a time it fits: kvhub fit --capture two-phase"
    if mode.passes == 1:
        two = _choose(plan.source, plan.target, plan.workload, plan.device, plan.ranks, "two-pass", None, **again)
        if two.fits:
            return text + f"; two-pass statistics fit ({two.statistics.describe()}): kvhub fit --stats two-pass"
    if plan.capture == "two-phase" and plan.spool_free is not None and plan.memory["spool"] > plan.spool_free:
        return text + "; the spool does not fit the disk: point KVHUB_CACHE at a larger one"
    if plan.target_layout == "whole" and plan.device.gpu and plan.memory["device_peak"] > plan.device.memory:
        outer = _layer_outer(plan.source, plan.target, plan.workload, plan.device, plan.ranks, "auto", plan.spool_free)
        if outer.fits:
            return text + (
                "; the larger model alone does not fit one device, but run layer by layer it fits "
                f"({_where(outer)}): kvhub fit --target-layout layer-outer"
            )
        return text + "; the larger model alone does not fit one device, even run layer by layer: use larger devices"
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
    capture: str = "one-phase",
    spool_free: int | None = None,
    target_layout: str = "whole",
) -> Plan:
    """The plan with the fewest ranks (up to ``max_ranks``) that fits in one pass, else the fewest that fits
    in two passes (unless ``statistics`` forces one), else the ``max_ranks`` plan (its advice says why)."""
    ranks = [r for r in RANK_CHOICES if r <= max_ranks] or [1]
    kinds = [statistics] if statistics != "auto" else ["one-pass", "two-pass"]
    for kind in kinds:
        for count in ranks:
            plan = plan_fit(
                source,
                target,
                workload,
                device,
                ranks=count,
                statistics=kind,
                capture=capture,
                spool_free=spool_free,
                target_layout=target_layout,
            )
            if plan.fits:
                return plan
    return plan_fit(
        source,
        target,
        workload,
        device,
        ranks=ranks[-1],
        statistics=statistics,
        capture=capture,
        spool_free=spool_free,
        target_layout=target_layout,
    )
