"""``kvhub bench``: time transfer() against the target's re-prefill, and the handoff's time to first token
against a full prefill (:mod:`kvhub.eval.continuation` runs them); stored as metrics of the version."""

from __future__ import annotations

import click

from kvhub.cli.eval_tables import number
from kvhub.cli.options import chosen_dtype, db_option, dtype_option
from kvhub.cli.output import echo_json, format_option, print_table
from kvhub.errors import ConfigError
from kvhub.serving.spec import SELECTORS, Recompute


def _lengths(ctx, param, value: str) -> list[int]:
    """--lengths as token counts; a word that is not one is a usage error naming the form (exit 2)."""
    words = [word.strip() for word in value.split(",") if word.strip()]
    if not words or not all(word.isdigit() and int(word) >= 2 for word in words):
        raise click.BadParameter(
            f"{value!r}: give context lengths in tokens (whole numbers >= 2) separated by "
            "commas, e.g. --lengths 1024,4096,65536",
            ctx=ctx,
            param=param,
        )
    return [int(word) for word in words]


@click.command("bench")
@click.argument("ref")
@click.option(
    "--lengths",
    default="256,1024,4096",
    show_default=True,
    callback=_lengths,
    help="Context lengths in tokens, comma-separated (e.g. 1024,4096,65536).",
)
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True)
@click.option(
    "--exact-prefix",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Include this exact-prefix recompute in the handoff's time to first token.",
)
@click.option(
    "--exact-suffix",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Include this exact-suffix recompute in the handoff's time to first token.",
)
@click.option(
    "--exact-budget",
    type=click.FloatRange(0, 1),
    default=0.0,
    show_default=True,
    help="Include a selective recompute of this fraction of the context (token selection included).",
)
@click.option(
    "--select",
    type=click.Choice(SELECTORS),
    default="source",
    show_default=True,
    help="Token selector of --exact-budget.",
)
@click.option(
    "--variant",
    "spec",
    default=None,
    metavar="SPEC",
    help="A full recompute spec instead of the four options above, e.g. 'exact_prefix=4,exact_suffix=16,"
    "exact_budget=0.08,select=target,queries=4', or 'handoff' for kvhub.handoff's defaults.",
)
@click.option("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available).")
@dtype_option("dtype of both models and the mapped cache.")
@db_option
@format_option
def bench(
    ref, lengths, repeats, exact_prefix, exact_suffix, exact_budget, select, spec, device, dtype, db, output_format
):
    """Time transfer() against the target re-prefilling the same context (interleaved, same device/dtype),
    and the handoff's time to first token against a full prefill.  Stored as metrics of the version."""
    from kvhub.cli import eval_cmd
    from kvhub.cli.progress import progress_callback
    from kvhub.eval.continuation import time_transfer_vs_prefill, timing_metric_rows
    from kvhub.eval.run import parse_variant

    recompute = Recompute(exact_prefix, exact_suffix, exact_budget, select)
    if spec is not None and recompute.name():
        raise ConfigError(
            "--variant is the whole recompute spec: leave out --exact-prefix/--exact-suffix/"
            "--exact-budget, or put them into the --variant text"
        )
    recompute = parse_variant(spec) if spec is not None else recompute
    eval_cmd.check_device_and_dtype(device, dtype)
    dtype = chosen_dtype(dtype, device)
    store, loaded = eval_cmd._load_version(
        ref, db, device=device, dtype=dtype, context_tokens=lengths, lengths_option="--lengths"
    )  # beyond the models' positions: refused, not timed
    with store:
        loaded.mapper.to(device=next(loaded.target.parameters()).device)
        with progress_callback("repeats") as progress:
            rows = time_transfer_vs_prefill(
                loaded.mapper,
                loaded.source,
                loaded.target,
                lengths=lengths,
                repeats=repeats,
                recompute=recompute,
                progress=progress,
            )
        timings = timing_metric_rows(rows, device=loaded.device, dtype=dtype, variant=recompute.name(), repeats=repeats)
        store.add_metrics(loaded.version, timings)
        reference = store.reference(loaded.version)
    if output_format == "json":
        from kvhub.eval.run import variant_config

        echo_json(
            {
                "ref": loaded.version.ref,
                "device": loaded.device,
                "dtype": dtype,
                "variant": variant_config(recompute),
                "exact_prefix": recompute.exact_prefix,
                "exact_suffix": recompute.exact_suffix,
                "exact_budget": recompute.exact_budget,
                "select": recompute.select,
                "rows": rows,
            }
        )
        return
    # the handoff column is what this run recomputes: the map alone unless asked (kvhub.handoff's default
    # recomputes 4 + 16 tokens and 8% of the context: --variant handoff)
    handoff = "handoff TTFT s" if recompute.name() else "map-alone TTFT s"
    columns = ["tokens", "transfer s", "re-prefill s", "speedup", handoff, "full TTFT s", "TTFT speedup"]
    table = [
        [
            r["tokens"],
            number(r["transfer_median_s"]),
            number(r["prefill_median_s"]),
            f"{r['speedup']:.1f}x",
            number(r["handoff_ttft_median_s"]),
            number(r["full_ttft_median_s"]),
            f"{r['ttft_speedup']:.1f}x",
        ]
        for r in rows
    ]
    what = (
        f", {recompute.name()}"
        if recompute.name()
        else ", the map alone (kvhub.handoff's default also recomputes tokens: --variant handoff)"
    )
    print_table(
        columns,
        table,
        output_format=output_format,
        right=tuple(columns),
        title=f"{reference} on {loaded.device} ({dtype}){what}",
    )


def attach(group: click.Group) -> None:
    """Register bench on the ``kvhub`` group."""
    group.add_command(bench)
