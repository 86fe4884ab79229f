"""``kvhub plan``: the memory, FLOPs, time and mode of a fit, from the two configs (no weights)."""

from __future__ import annotations

import dataclasses
import json
import math

import click

from kvhub.cli.console import console, say


def _k_option(ctx, param, value: str):
    if value == "auto":
        return None
    try:
        k = int(value)
    except ValueError:
        k = 0
    if k < 1:
        raise click.BadParameter(f"{value!r}: use a positive integer or 'auto'")
    return k


def _finite(ctx, param, value: float | None):
    """FloatRange lets nan and inf through; a memory size must be a finite number."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value}: give a finite number of GiB")
    return value


@click.command()
@click.option("--src", required=True, help="Source model: Hub id, known model name, model directory or config.json.")
@click.option("--dst", required=True, help="Target model, as --src.")
@click.option("--samples", type=click.IntRange(min=1), default=None, help="Training sequences [recipe default: 64].")
@click.option("--heldout", type=click.IntRange(min=0), default=None,
              help="Held-out sequences [default: a 20% share, as calibration recipes do].")
@click.option("--seq-len", type=click.IntRange(min=1), default=None, help="Tokens per sequence [recipe default: 512].")
@click.option("--stride", type=click.IntRange(min=1), default=None, help="Token stride [recipe default: 4].")
@click.option("--batch-size", type=click.IntRange(min=1), default=4, show_default=True, help="Sequences per forward pass.")
@click.option("--k", "k", default="auto", show_default=True, callback=_k_option,
              help="Source layers per target layer, or 'auto' (costed at the largest k of the grid).")
@click.option("--ranks", type=click.IntRange(min=1), default=None,
              help="Plan for this many ranks [default: the fewest of 1, 2, 4, 8 that fits in one pass, else in "
                   "two].")
@click.option("--device", default=None, help="cpu, cuda (the local GPU), h100, h200 or a100 [default: cuda if present].")
@click.option("--dtype", default="bfloat16", show_default=True, help="Model dtype of the forward passes.")
@click.option("--stats", "statistics", type=click.Choice(["auto", "one-pass", "two-pass"]), default="auto",
              show_default=True, help="Statistics mode to plan: 'auto' = one pass when it fits, else two passes "
                                      "(probe, then only candidate source layers) when they fit.")
@click.option("--candidates", type=click.IntRange(min=1), default=None,
              help="Two passes: the source layers pass 2 keeps [default: the most that fit].")
@click.option("--host-memory", type=click.FloatRange(min=0, min_open=True), default=None, metavar="GIB",
              callback=_finite,
              help="RAM of the machine that holds the statistics, in GiB [default: the device profile's; this "
                   "machine's for cpu].")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON on stdout.")
def plan(src, dst, samples, heldout, seq_len, stride, batch_size, k, ranks, device, dtype, statistics, candidates,
         host_memory, as_json):
    """Plan a fit of SRC -> DST: memory per rank, artifact size, FLOPs, time, mode and rank count.

    \b
    kvhub plan --src Qwen/Qwen3-14B --dst Qwen/Qwen3-32B --samples 256 --seq-len 2048 --device h100 --ranks 8

    Reads only the configs.  Times are estimates from nominal device rates; kvhub fit makes the same
    plan against the memory free when it starts: it takes the statistics mode planned here, and
    refuses a fit that does not fit the machine, with this command's advice.
    """
    from kvhub.fitting.plan import GIB, device_profile, plan_fit, recommend, shape_of, workload_for

    source, target = shape_of(src), shape_of(dst)
    workload = workload_for(samples=samples, heldout=heldout, seq_len=seq_len, stride=stride, batch_size=batch_size,
                            k=k, dtype=dtype)
    _warn_past_positions(workload.seq_len, source, target)
    profile = device_profile(device or _default_device())
    if host_memory is not None:  # a CPU device is its own host
        field = "host_memory" if profile.gpu else "memory"
        profile = dataclasses.replace(profile, **{field: int(host_memory * GIB)})
    if ranks or candidates:
        result = plan_fit(source, target, workload, profile, ranks=ranks or 1, statistics=statistics,
                          candidates=candidates)
    else:
        result = recommend(source, target, workload, profile, statistics=statistics)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
        return
    _print_plan(result)


def _warn_past_positions(seq_len: int, *shapes) -> None:
    """A sequence longer than a model's max_position_embeddings: planned (RoPE scaling may allow it), with a warning."""
    for shape in shapes:
        if shape.max_positions is not None and seq_len > shape.max_positions:
            say(f"--seq-len {seq_len} is longer than the {shape.max_positions} positions of {shape.model_id} "
                "(max_position_embeddings); a fit that long runs the model past what it was trained on",
                label="warning:", style="yellow")


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _print_plan(result) -> None:
    from rich.table import Table

    from kvhub.fitting.plan import GIB

    w = result.workload
    say(f"{result.source.model_id} -> {result.target.model_id} on {result.ranks} x {result.device.name}: "
        f"{w.samples} + {w.heldout} sequences x {w.seq_len} tokens, stride {w.stride}, batch {w.batch_size}, "
        f"k {result.k}{' (auto: largest)' if w.k is None else ''}, {w.dtype}", to=console)
    table = Table(title="memory per rank (GiB)")
    table.add_column("where")
    table.add_column("part")
    table.add_column("GiB", justify="right")
    device = "device" if result.device.gpu else "RAM"
    host = "host" if result.device.gpu else "RAM"
    parts = [(device, "weights"), (device, "activations"), (device, "exchange"), (host, "statistics"),
             (host, "update"), (host, "solve"), (device, "device_peak"), (host, "host_peak")]
    if result.statistics.passes == 2:
        parts[4:4] = [(host, "statistics_pass1"), (host, "statistics_pass2")]
    for where, part in parts:
        table.add_row(where, part.replace("_", " "), f"{result.memory[part] / GIB:,.2f}")
    console.print(table)
    console.print(f"artifact {result.artifact_bytes / GIB:,.2f} GiB; calibration forward {result.flops['forward']:.3g} FLOPs "
                  f"(all ranks), statistics {result.flops['statistics']:.3g} and solve {result.flops['solve']:.3g} "
                  f"FLOPs per rank; exchange {result.exchange_bytes / GIB:,.2f} GiB received per rank")
    seconds = result.seconds
    console.print("estimated time: " + ", ".join(f"{name} {seconds[name]:,.0f} s" for name in seconds))
    console.print(f"statistics: {result.statistics.describe()}")
    console.print(f"mode [bold]{result.mode}[/] on {result.ranks} rank(s): {result.advice}")
