"""``kvhub fit``: calibration set -> both models' caches -> statistics -> solve -> artifact (-> store)."""

from __future__ import annotations

import dataclasses
import shlex
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import click

from kvhub.cli.console import console, say
from kvhub.cli.options import chosen_dtype, db_option, dtype_option, open_db
from kvhub.artifact.metadata import describe_structure, shown
from kvhub.cli.fit_options import fit_options
from kvhub.cli.output import echo_json, format_option, json_ref, print_table
from kvhub.calib.recipe import DEFAULT_CALIBRATION
from kvhub.errors import ConfigError, FitInterrupted, NotFoundError
from kvhub.fitting.options import FitOptions
from kvhub.fitting.torchrun import launch_torchrun


@click.command()
@click.option("--src", required=True, help="Source (small) model: Hugging Face id, local model dir, or .gguf file.")
@click.option("--dst", required=True, help="Target (large) model of the same family and tokenizer.")
@click.option(
    "--calib",
    default=DEFAULT_CALIBRATION,
    show_default=True,
    help="Calibration set: a built-in name (kvhub calib list), a .txt/.jsonl file, a directory, "
    "a recipe .toml, or hf:DATASET[:CONFIG]:SPLIT:FIELD.",
)
@click.option(
    "--name",
    default=None,
    help="Name of the calibration set in the store, the CALIB of SRC:DST:CALIB [default: the --calib "
    "name or file stem]. A series holds one text: other text under a used name is refused.",
)
@click.option("--out", type=click.Path(path_type=Path), help="Also export the artifact directory here.")
@click.option("--samples", type=int, help="Training sequences (overrides the recipe).")
@click.option("--seq-len", type=int, help="Tokens per sequence (overrides the recipe).")
@fit_options("stride", "top_k", "ridge_lambda", "weighting", "head_local", "rank")
@click.option(
    "--device",
    default=None,
    help="torch device for the forward passes: cpu, cuda or cuda:N [default: cuda if available, else cpu].",
)
@dtype_option("Model dtype for the forward passes.")
@fit_options("batch_size")
@click.option("--seed", type=int, help="Seed of the calibration sampling (overrides the recipe).")
@click.option("--restart", is_flag=True, help="Ignore a checkpoint of an interrupted run of the same fit.")
@db_option
@click.option("--no-register", is_flag=True, help="Do not register the mapper in the store (needs --out).")
@click.option(
    "--distributed",
    "nproc",
    type=click.IntRange(min=2),
    default=None,
    help="Fit on N processes of this machine (one GPU each with CUDA, else gloo on CPU): runs "
    "torchrun --standalone --nproc-per-node N -m kvhub fit with the other options. Under torchrun "
    "(WORLD_SIZE > 1; multi-node through its rendezvous) kvhub fit joins the job by itself.",
)
@fit_options("statistics", "candidates", "capture", "target_layout")
@fit_options("map_kind", "mlp_width", "mlp_depth", "mlp_tokens", "mlp_epochs")
@click.option(
    "--ignore-plan", is_flag=True, help="Fit even when kvhub plan says the machine's free memory cannot hold the fit."
)
@format_option
def fit(
    src,
    dst,
    calib,
    name,
    out,
    samples,
    seq_len,
    device,
    dtype,
    seed,
    restart,
    db,
    no_register,
    nproc,
    ignore_plan,
    output_format,
    **knobs,
):
    """Fit a KV-cache mapper from SRC's cache to DST's cache.

    \b
    kvhub fit --src Qwen/Qwen2.5-Coder-0.5B-Instruct --dst Qwen/Qwen2.5-Coder-1.5B-Instruct --calib legal-docs

    An interrupted fit (Ctrl-C: exit 130, with the batch it stopped at) continues from its last
    checkpoint when run again with the same arguments (statistics are checkpointed every few batches,
    and when a two-pass fit's first pass ends); --restart starts over.  A distributed fit keeps one
    checkpoint per rank and resumes when restarted with the same number of processes.

    When the full statistics do not fit the memory free now, --stats auto (the default) keeps their
    totals in fp32, or failing that accumulates them in two passes (see kvhub plan): the mapper then
    chooses its source layers among the candidates the first pass probed best.
    """
    if no_register and out is None:
        raise ConfigError("--no-register needs --out DIR, or the fitted mapper would be lost")
    if out is not None and Path(out).exists():
        raise ConfigError(f"{out} already exists; choose a new --out directory")
    from kvhub.cli.progress import quiet_other_bars
    from kvhub.fitting.distributed import launched
    from kvhub.fitting.job import FitRequest, check_plan

    request = FitRequest(
        src=src,
        dst=dst,
        calib=calib,
        name=name,
        samples=samples,
        seq_len=seq_len,
        seed=seed,
        device=device,
        dtype=chosen_dtype(dtype, device, quiet=launched()),  # the launcher said it once
        restart=restart,
        options=FitOptions(**knobs),
    )
    quiet_other_bars(load_transformers=True)  # the models load before kvhub's first bar
    if not launched():  # a rank checks for itself (fit_by_names_distributed)
        _refuse_early(request, db=db, register=not no_register, distributed=bool(nproc))
    if nproc:
        raise SystemExit(launch_torchrun(nproc, sys.argv[1:], notify=say))
    if launched():
        mapper = _fit_rank(request, ignore_plan=ignore_plan)
        if mapper is None:  # ranks other than 0: rank 0 saves, registers and reports
            return
    else:
        if not ignore_plan:
            _say_statistics(check_plan(request))
        mapper = _fit_here(request)
    reference = full_ref = None
    with tempfile.TemporaryDirectory(prefix="kvhub-fit-") as tmp:
        artifact = mapper.save(Path(tmp) / "mapper")
        if out is not None:  # first: a refused registration never loses the fit
            mapper.save(out)
        if not no_register:
            reference, full_ref = _register(artifact, db)
    _print_summary(mapper, reference=reference, full_ref=full_ref, out=out, output_format=output_format)


def _refuse_early(request, *, db: str | None, register: bool, distributed: bool) -> None:
    """:func:`kvhub.fitting.job.check_request`, with the store the fit registers in; before torchrun starts
    N ranks, also what a rank would refuse (--map mlp runs in one process)."""
    from kvhub.fitting.job import check_request
    from kvhub.fitting.mlp_fit import check_options

    if distributed:
        check_options(request.options, heldout_sequences=1, distributed=True)
    with _existing_store(db, register=register) as store:
        check_request(request, store=store)


@contextmanager
def _existing_store(db: str | None, *, register: bool):
    """The store the fit will register in, open; None without one (nothing to clash with) or with
    --no-register."""
    if not register:
        yield None
        return
    try:
        store = open_db(db, create=False)
    except NotFoundError:
        yield None
        return
    with store:
        yield store


def _fit_here(request):
    """The fit in this process; Ctrl-C ends it with exit 130 and a line saying how to go on."""
    from kvhub.cli.progress import progress_callback
    from kvhub.fitting.job import fit_by_names

    try:
        return fit_by_names(request, notify=say, progress=progress_callback)
    except FitInterrupted as exc:
        of_pass = f" of pass {exc.pass_index}" if exc.pass_index > 1 else ""
        if exc.phase == 1:
            say(
                f"Interrupted in phase 1 (the source's captures) at batch {exc.batch}/{exc.batches}; the spool keeps "
                f"{exc.resume_from} batches: run the same command to resume (--restart to start over)",
                style="bold",
            )
            raise SystemExit(exc.exit_code) from None
        if exc.resume_from is None:
            then = "nothing was checkpointed yet; run the same command to start again"
        else:
            then = "run the same command to resume (--restart to start over)"
        say(f"Interrupted at batch {exc.batch}/{exc.batches}{of_pass}; {then}", style="bold")
        raise SystemExit(exc.exit_code) from None


def _say_statistics(plan) -> None:
    """Tell the user how the plan says the statistics will be accumulated (None: no plan before loading)."""
    if plan is not None:
        say(f"statistics: {plan.statistics.describe()} (kvhub plan: {plan.advice})", label="plan:")


def _fit_rank(request, *, ignore_plan: bool):
    """This process's part of a torchrun job; the Mapper on rank 0, None elsewhere."""
    import torch.distributed as dist

    from kvhub.fitting.distributed import die_with_launcher, init_group
    from kvhub.fitting.job import check_plan, fit_by_names_distributed
    from kvhub.cli.progress import progress_callback

    die_with_launcher()
    group = init_group(request.device)
    try:
        if not ignore_plan:  # CPU ranks share this machine's memory: the plan counts every rank
            plan = check_plan(request, ranks=group.world)
            if group.is_main:
                _say_statistics(plan)
        return fit_by_names_distributed(
            request, group=group, notify=say, progress=progress_callback if group.is_main else None
        )
    finally:
        dist.destroy_process_group()


# fit's parameters that say what the mapper is made of, besides FitOptions' knobs; the others (--db, --out,
# --format, --restart, --distributed, ...) say how the command ran and are left out of the lineage (U4-18)
FIT_INPUTS = ("src", "dst", "calib", "samples", "seq_len", "seed", "dtype", "device")


def _lineage() -> dict:
    """What the store records of a fit: the command, kvhub's version and the options that made the mapper as
    given (the models, the calibration set, its sampling, dtype, device type and the fit's knobs; the
    mapper.json's fit block holds the options the fit resolved)."""
    from kvhub import __version__

    params = click.get_current_context().params
    kept = set(FIT_INPUTS) | {knob.name for knob in dataclasses.fields(FitOptions)}
    options = {key: value for key, value in params.items() if key in kept}
    if options.get("device"):  # cuda:1 and cuda:0 fit the same mapper
        options["device"] = options["device"].split(":")[0]
    return {
        "created_by": "kvhub fit",
        "kvhub_version": __version__,
        "options": {
            key: value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
            for key, value in sorted(options.items())
        },
    }


def _register(artifact: Path, db: str | None) -> tuple[str, str]:
    """(the short reference people read, the full one JSON carries) of the registered version."""
    with open_db(db) as store:
        existing = store.registered_as(artifact)  # identical tensors are one version
        version = existing or store.register(artifact, lineage=_lineage())
        if existing is not None:
            say(
                f"the store already holds these exact weights as {store.reference(existing)}; no new version",
                label="note:",
            )
        return store.reference(version), json_ref(version)


LAYER_COLUMNS = ["target layer", "source layers", "k", "lambda K/V", "held-out R2 K", "held-out R2 V"]


def _layer_rows(mapper) -> list[list[str]]:
    rows = []
    for layer in mapper.layers:
        r2 = [f"{layer[n]:.3f}" if layer[n] is not None else "-" for n in ("r2_k", "r2_v")]
        rows.append(
            [
                str(layer["target"]),
                ",".join(map(str, layer["sources"])),
                str(len(layer["sources"])),
                f"{layer['lambda_k']:g}/{layer['lambda_v']:g}",
                *r2,
            ]
        )
    return rows


def _print_summary(mapper, *, reference, full_ref, out, output_format: str) -> None:
    """The fit's summary on stdout: JSON (``ref`` the full reference, as every command's JSON), the layer
    table as TSV (the rest on stderr), or the table and the summary lines."""
    metrics = mapper.metadata["metrics"]
    if output_format == "json":
        echo_json(
            {
                "ref": full_ref,
                "out": str(out) if out else None,
                "metrics": metrics,
                "k": shown(mapper.metadata.get("k")),
                "lambda": shown(mapper.metadata.get("lambda")),
                "layers": mapper.layers,
                "timings": mapper.metadata["fit"]["timings"],
                "statistics": mapper.metadata["fit"].get("statistics"),
                "kind": mapper.kind.name,
            }
        )
        return
    print_table(
        LAYER_COLUMNS,
        _layer_rows(mapper),
        output_format=output_format,
        right=tuple(LAYER_COLUMNS),
        title=f"{mapper.source['model_id']} -> {mapper.target['model_id']}",
    )
    to = console if output_format == "table" else None  # TSV keeps stdout to its rows
    if "heldout_r2_k_mean" in metrics:
        say(
            f"held-out R2 K mean {metrics['heldout_r2_k_mean']:.3f} (min {metrics['heldout_r2_k_min']:.3f}), "
            f"V mean {metrics['heldout_r2_v_mean']:.3f} (min {metrics['heldout_r2_v_min']:.3f})",
            to=to,
        )
    say(
        f"maps: {describe_structure(mapper.metadata.get('structure'))}, {mapper.kind.describe(mapper.kind_settings())}, "
        f"{mapper.num_parameters():,} parameters; "
        f"token weighting: {mapper.metadata['fit'].get('weighting', 'uniform')}",
        to=to,
    )
    timings = mapper.metadata["fit"]["timings"]
    say(
        f"forward {timings.get('forward_s', 0):.1f} s, statistics {timings.get('stats_s', 0):.1f} s, "
        f"solve {timings.get('solve_s', 0):.1f} s",
        to=to,
    )
    for note in mapper.metadata.get("notes", []):
        say(note, label="note:")
    if reference:
        say(reference, label="registered", style="bold", to=to)
    if out:
        say(f"exported to {out}", to=to)
    say(_next_commands(reference, out), label="next:")


def _next_commands(reference: str | None, out) -> str:
    """What to run after a fit: look at, evaluate and publish the registered version, or register an export."""
    if not reference:
        return f"kvhub import {shlex.quote(str(out))}"
    ref = shlex.quote(reference)
    return f"kvhub show {ref}; kvhub eval {ref} --task hellaswag; kvhub push {ref} --repo OWNER/NAME"
