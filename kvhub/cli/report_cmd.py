"""``kvhub report``: the R^2 heatmap, per-layer R^2, retention, recompute-budget and speedup plots and a markdown
summary of a version, from what the store holds (:mod:`kvhub.eval.report` writes them)."""

from __future__ import annotations

from pathlib import Path

import click

from kvhub.cli.console import console, say
from kvhub.cli.options import db_option, open_db
from kvhub.cli.output import format_option, json_ref, print_record


@click.command("report")
@click.argument("ref")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path))
@db_option
@format_option
def report(ref, out, db, output_format):
    """Write the R^2 heatmap, per-layer R^2, retention, recompute-budget and speedup plots, and a markdown
    summary, to OUT, from what the store holds (nothing is evaluated).

    Needs matplotlib: pip install 'kvhub[plots]'.  layer_r2.png shows the held-out R^2 of the stored
    maps themselves (compressed maps included); r2_heatmap.png the full-rank one-layer probe that chose
    their source layers; retention.png the retention (mapped / own accuracy, 95% interval) of every task
    `kvhub eval` stored, beside each condition's accuracy.  budget.png: per task and selector, retention
    (exact match for facts and the other generation tasks) against the recompute budget of the variants
    `kvhub eval --exact-budget ...` stored, with drop (the recomputed tokens alone) at the same budget; a gist
    task shows its gap closed by NLL and, where it was scored by generation, a second curve of the gap closed by
    generation.
    speedup.png: the handoff's time-to-first-token gain and transfer()'s speedup against the context tokens
    `kvhub bench --lengths ...` timed.  A curve with fewer than two points stored is not drawn: report.md
    and a note name the command that measures it.  Every title names the mapper and its version.
    """
    import shutil

    from kvhub.core.mapper import read_metadata
    from kvhub.eval.curves import hints
    from kvhub.eval.plots import require_matplotlib
    from kvhub.eval.report import task_results, write_report

    require_matplotlib()  # before anything is written
    with open_db(db, create=False) as store:
        version = store.resolve(ref)
        metadata = read_metadata(store.artifact_path(version))
        measurements = store.metrics(version)
        tasks = task_results(measurements)
        reference = store.reference(version)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        path = write_report(
            out, reference=reference, version=version, metadata=metadata, tasks=tasks, measurements=measurements
        )
    except BaseException:
        if created:  # no half-written folder left behind
            shutil.rmtree(out, ignore_errors=True)
        raise
    for hint in hints(reference, measurements):  # report.md says the same
        say(hint, label="note:")
    if not print_record(
        {"ref": json_ref(version), "report": str(path), "files": sorted(str(p) for p in out.iterdir() if p.is_file())},
        output_format=output_format,
    ):
        say(f"wrote {path}", to=console)


def attach(group: click.Group) -> None:
    """Register report on the ``kvhub`` group."""
    group.add_command(report)
