"""``kvhub plan``: the memory, FLOPs, time and mode of a fit, from the two configs (no weights)."""

from __future__ import annotations

import dataclasses
import math

import click

from kvhub.cli.console import console, say
from kvhub.cli.fit_options import fit_option, fit_options
from kvhub.cli.output import echo_json, format_option, print_table


def _finite(ctx, param, value: float | None):
    """FloatRange lets nan and inf through; a memory size must be a finite number."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value}: give a finite number of GiB")
    return value


@click.command()
@click.option("--src", required=True, help="Source model: Hub id, known model name, model directory or config.json.")
@click.option("--dst", required=True, help="Target model, as --src.")
@click.option("--samples", type=click.IntRange(min=1), default=None, help="Training sequences [recipe default: 64].")
@click.option(
    "--heldout",
    type=click.IntRange(min=0),
    default=None,
    help="Held-out sequences [default: a 20% share, as calibration recipes do].",
)
@click.option("--seq-len", type=click.IntRange(min=1), default=None, help="Tokens per sequence [recipe default: 512].")
@fit_options("stride", "batch_size")
@fit_option("top_k", help="Source layers per target layer, or 'auto' (costed at the largest k of the grid).")
@click.option(
    "--ranks",
    type=click.IntRange(min=1),
    default=None,
    help="Plan for this many ranks [default: the fewest of 1, 2, 4, 8 that fits in one pass, else in two].",
)
@click.option(
    "--device", default=None, help="cpu, cuda (the local GPU), h100, h200 or a100 [default: cuda if present]."
)
@click.option(
    "--dtype",
    default=None,
    help="Model dtype of the forward passes [default: what kvhub fit takes there: bfloat16, or float32 on a "
    "CPU that emulates bf16 (no avx512_bf16/amx_bf16)].",
)
@fit_options("statistics", "candidates", "capture", "target_layout", "map_kind", "mlp_tokens")
@click.option(
    "--host-memory",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    metavar="GIB",
    callback=_finite,
    help="RAM of the machine that holds the statistics, in GiB [default: the device profile's; this "
    "machine's for cpu].",
)
@format_option
def plan(
    src,
    dst,
    samples,
    heldout,
    seq_len,
    stride,
    batch_size,
    top_k,
    ranks,
    device,
    dtype,
    statistics,
    candidates,
    capture,
    target_layout,
    map_kind,
    mlp_tokens,
    host_memory,
    output_format,
):
    """Plan a fit of SRC -> DST: memory per rank, artifact size, FLOPs, time, mode and rank count.

    \b
    kvhub plan --src Qwen/Qwen3-14B --dst Qwen/Qwen3-32B --samples 256 --seq-len 2048 --device h100 --ranks 8

    Reads only the configs.  The first line is the verdict; the exit status is 4 when the fit does not
    fit (on --ranks, or on any of 1, 2, 4, 8 ranks) or has fewer training observations than features,
    which kvhub fit would refuse.  Times (h:mm:ss) are estimates from nominal device rates; kvhub fit
    makes the same plan against the memory free when it starts: it takes the statistics mode planned
    here, and refuses a fit that does not fit the machine, with this command's advice.
    """
    from kvhub.errors import FitError
    from kvhub.fitting.spool import free_bytes, spool_root
    from kvhub.fitting.plan import (
        GIB,
        device_profile,
        plan_fit,
        recommend,
        shape_of,
        too_few_observations,
        workload_for,
    )

    source, target = shape_of(src), shape_of(dst)
    profile = device_profile(device or _default_device())
    workload = workload_for(
        samples=samples,
        heldout=heldout,
        seq_len=seq_len,
        stride=stride,
        batch_size=batch_size,
        k=top_k,
        dtype=_plan_dtype(dtype, gpu=profile.gpu),
        mlp_tokens=_kept_rows(map_kind, mlp_tokens),
    )
    _warn_past_positions(workload.seq_len, source, target)
    if host_memory is not None:  # a CPU device is its own host
        field = "host_memory" if profile.gpu else "memory"
        profile = dataclasses.replace(profile, **{field: int(host_memory * GIB)})
    phases = {"capture": capture, "spool_free": free_bytes(spool_root()), "target_layout": target_layout}
    if ranks or candidates:
        result = plan_fit(
            source, target, workload, profile, ranks=ranks or 1, statistics=statistics, candidates=candidates, **phases
        )
    else:
        result = recommend(source, target, workload, profile, statistics=statistics, **phases)
    problem = too_few_observations(source, workload)
    if output_format == "json":
        echo_json({**result.to_dict(), "observations_problem": problem})
    elif output_format == "tsv":
        print_table(MEMORY_COLUMNS, _memory_rows(result, grouped=False), output_format="tsv")
    else:
        _print_plan(result, problem=problem, searched=not (ranks or candidates))
    if problem is not None or not result.fits:
        raise SystemExit(FitError.exit_code)


def _kept_rows(map_kind: str | None, mlp_tokens: int | None) -> int:
    """The rows per split a fit of ``map_kind`` keeps for its MLPs (0 for ridge), the knob's default when unset."""
    from kvhub.fitting.options import FitOptions

    if (map_kind or FitOptions().map_kind) == "ridge":
        return 0
    return mlp_tokens or FitOptions().mlp_tokens


def _warn_past_positions(seq_len: int, *shapes) -> None:
    """A sequence longer than a model's max_position_embeddings: planned (RoPE scaling may allow it), with a warning."""
    for shape in shapes:
        if shape.max_positions is not None and seq_len > shape.max_positions:
            say(
                f"--seq-len {seq_len} is longer than the {shape.max_positions} positions of {shape.model_id} "
                "(max_position_embeddings); a fit that long runs the model past what it was trained on",
                label="warning:",
                style="yellow",
            )


def _plan_dtype(dtype: str | None, *, gpu: bool) -> str:
    """--dtype, else what kvhub fit takes on that device (kvhub.dtypes.default_dtype); on a CPU that emulates
    bf16 one line says so, since the time then depends on the dtype about 3x."""
    from kvhub.dtypes import EMULATED_BF16, canonical_name, cpu_native_bf16, default_dtype

    if gpu:
        return dtype or "bfloat16"
    if dtype is None:
        dtype, note = default_dtype("cpu")
        if note:
            say(note, label="note:")
    elif canonical_name(dtype) == "bfloat16" and cpu_native_bf16() is False:
        say(f"{EMULATED_BF16}: --dtype {dtype} is costed at that rate; float32 is about 3x faster here", label="note:")
    return dtype


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


MEMORY_COLUMNS = ["where", "part", "GiB", "limit GiB"]


def _memory_rows(result, *, grouped: bool = True) -> list[list[str]]:
    """Memory per rank by where it lives: on a GPU the device's parts, then the host's; on a CPU one pool
    (RAM).  Each pool ends with its peak per rank and what all the ranks sharing it need, against its size.
    GiB with two decimals (``grouped``: and thousands separators, for people)."""
    from kvhub.fitting.plan import GIB

    memory, device = result.memory, result.device
    gib = lambda nbytes: f"{nbytes / GIB:{',' if grouped else ''}.2f}"  # noqa: E731
    statistics = [("statistics", "statistics")]
    if result.statistics.passes == 2:
        statistics += [("statistics, pass 1", "statistics_pass1"), ("statistics, pass 2", "statistics_pass2")]
    weights = "model weights" if result.capture == "one-phase" else "model weights (the larger model)"
    if result.target_layout == "layer-outer":
        weights = "model weights (the source, or one target layer + embedding)"
    parts = {"weights": weights, "activations": "activations", "exchange": "exchange buffers"}
    host_parts = [*statistics, ("statistics update", "update"), ("solve", "solve")]
    if memory.get("samples"):
        host_parts.append(("MLP row samples", "samples"))
    if result.target_layout == "layer-outer":
        host_parts += [("target weights (layer-outer)", "target_weights_host"), ("hidden states", "hidden_states")]
    on_host = min(result.ranks, device.devices_per_host) if device.gpu else result.ranks
    disk = []
    if result.capture == "two-phase":
        free = "" if result.spool_free is None else gib(result.spool_free)
        disk = [
            ["disk", "spool per rank", gib(memory["spool"]), ""],
            ["disk", f"{on_host} rank(s) on a host", gib(memory["spool"] * on_host), free],
        ]
    if not device.gpu:
        rows = [["RAM", name, gib(memory[key]), ""] for key, name in parts.items()]
        rows += [["RAM", name, gib(memory[key]), ""] for name, key in host_parts]
        return rows + [
            ["RAM", "peak per rank", gib(memory["peak"]), ""],
            ["RAM", f"all {result.ranks} rank(s)", gib(memory["peak"] * result.ranks), gib(device.memory)],
            *disk,
        ]
    rows = [["device", name, gib(memory[key]), ""] for key, name in parts.items()]
    rows.append(["device", "peak per rank", gib(memory["device_peak"]), gib(device.memory)])
    rows += [["host", name, gib(memory[key]), ""] for name, key in host_parts]
    shared = ["host", f"{on_host} rank(s) on a host", gib(memory["host_peak"] * on_host), gib(device.host_memory)]
    return rows + [["host", "peak per rank", gib(memory["host_peak"]), ""], shared, *disk]


def _clock(seconds: float) -> str:
    """h:mm:ss."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def _verdict(result, *, problem: str | None, searched: bool) -> str:
    if problem is not None:
        return f"kvhub fit would refuse: {problem}"
    if result.fits:
        layout = ", target layer by layer" if result.target_layout == "layer-outer" else ""
        return (
            f"fits on {result.ranks} rank(s) of {result.device.name} ({result.statistics.describe()}, "
            f"{result.capture} capture{layout})"
        )
    tried = f"on 1 to {result.ranks} ranks" if searched else f"on {result.ranks} rank(s)"
    return f"does not fit {tried} of {result.device.name}; the last line says what would"


def _print_plan(result, *, problem: str | None, searched: bool) -> None:
    """The verdict, the workload, the memory table, cost and time, and the plan's advice."""
    from kvhub.fitting.plan import GIB

    w = result.workload
    say(_verdict(result, problem=problem, searched=searched), label="verdict:", style="bold", to=console)
    say(
        f"{result.source.model_id} -> {result.target.model_id}: {w.samples} + {w.heldout} sequences x {w.seq_len} "
        f"tokens, stride {w.stride}, batch {w.batch_size}, k {result.k}{' (auto: largest)' if w.k is None else ''}, "
        f"{w.dtype}",
        to=console,
    )
    print_table(
        MEMORY_COLUMNS,
        _memory_rows(result),
        title=f"memory per rank, {result.ranks} rank(s) of {result.device.name}",
        right=("GiB", "limit GiB"),
    )
    say(
        f"artifact {result.artifact_bytes / GIB:,.2f} GiB; calibration forward {result.flops['forward']:.3g} FLOPs "
        f"(all ranks), statistics {result.flops['statistics']:.3g} and solve {result.flops['solve']:.3g} FLOPs per "
        f"rank; exchange {result.exchange_bytes / GIB:,.2f} GiB received per rank",
        to=console,
    )
    seconds = result.seconds
    say("estimated time (h:mm:ss): " + ", ".join(f"{name} {_clock(seconds[name])}" for name in seconds), to=console)
    say(f"statistics: {result.statistics.describe()}", to=console)
    say(f"capture: {_phase_layout(result)}", to=console)
    say(f"mode {result.mode} on {result.ranks} rank(s): {result.advice}", to=console)


def _phase_layout(result) -> str:
    """Where the models run: both side by side, or the source then the target with the spool between them."""
    from kvhub.fitting.plan import GIB
    from kvhub.fitting.spool import spool_root

    source, target = result.source.model_id, result.target.model_id
    if result.capture == "one-phase":
        return f"one-phase: {source} and {target} resident together on every rank, each batch through both"
    passes = result.statistics.passes
    if result.target_layout == "layer-outer":
        target = f"{target} layer by layer (each decoder layer onloaded once, every batch through it)"
    free = "" if result.spool_free is None else f", {result.spool_free / GIB:,.1f} GiB free there"
    return (
        f"two-phase: phase 1 runs {source} alone over every batch and spools its captures "
        f"({result.memory['spool'] / GIB:,.2f} GiB per rank) to {spool_root()}{free}; phase 2 runs {target} alone "
        f"over the same batches{' twice (two statistics passes)' if passes == 2 else ''}, reading the spool back; "
        "kvhub fit --capture two-phase (auto picks it when it is what fits)"
    )
