"""``kvhub eval-serve``: score a running ``kvhub serve`` pair over HTTP on the tasks registered for it
(:mod:`kvhub.eval.catalog`: long-context, gist, the turns after an escalation), through ``kvhub eval``'s loop
(:func:`kvhub.eval.run.run_task`) over :class:`kvhub.eval.served_conditions.ServedConditions`; options, the
transfer check and tables (:mod:`kvhub.cli.eval_tables`) live here."""

from __future__ import annotations

import json
import math

import click

from kvhub.cli.console import say
from kvhub.cli.options import log_samples_option, output_path_option
from kvhub.cli.output import format_option
from kvhub.eval.catalog import SERVED_TASKS, SERVED_TURN_TASKS
from kvhub.errors import ConfigError

MAX_CONTEXT_TOKENS = 1 << 20  # longer prompts than any served model takes; 10^8 ran the client out of memory
MAX_TIMEOUT_S = 7 * 24 * 3600.0


@click.command("eval-serve")
@click.option(
    "--small",
    "small_url",
    required=True,
    metavar="URL",
    help="The small (producer) server's OpenAI base URL, e.g. http://127.0.0.1:8001/v1 (`kvhub serve "
    "--json` prints it).",
)
@click.option(
    "--large",
    "large_url",
    required=True,
    metavar="URL",
    help="The large (consumer) server's OpenAI base URL, e.g. http://127.0.0.1:8002/v1.",
)
@click.option(
    "--small-model",
    default=None,
    metavar="NAME",
    help="The small server's model name (default: the first id its /models lists).",
)
@click.option(
    "--large-model",
    default=None,
    metavar="NAME",
    help="The large server's model name (default: the first id its /models lists).",
)
@click.option(
    "--tokenizer",
    "tokenizer_spec",
    default=None,
    metavar="PATH_OR_ID",
    help="Tokenizer that builds the prompts' token ids: a model directory, .gguf file, tokenizer.json or "
    "model id (default: the small model's name; a model `kvhub fetch models` fetched is read from "
    "its local copy).",
)
@click.option(
    "--task",
    "tasks",
    multiple=True,
    required=True,
    type=click.Choice(SERVED_TASKS),
    help="Task (repeatable), as in `kvhub eval`: facts, multiturn or code (exact answers), or gist-chat, "
    "gist-document or gist-code (the large model's own answer about the whole context, scored "
    "teacher-forced), or turns (three turns after an escalation: facts and time to first token per turn).",
)
@click.option(
    "--context-tokens",
    "context_tokens",
    type=click.IntRange(min=64, max=MAX_CONTEXT_TOKENS),
    multiple=True,
    default=(1024,),
    show_default=True,
    help="Context length in tokens. Repeatable.",
)
@click.option(
    "--limit", type=click.IntRange(min=1), default=30, show_default=True, help="Items per task and length (seeded)."
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--agreement-tokens",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="Greedy tokens of own, mapped and control compared for the agreement column.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True, max=MAX_TIMEOUT_S),
    default=600,
    show_default=True,
    callback=lambda ctx, param, value: _finite(value),
    help="Seconds each request may take in all (connecting, waiting and reading the answer).",
)
@format_option
@output_path_option("<small>:<large>/results_<date>.json (as `kvhub eval` writes)")
@log_samples_option("id, gold, each condition's generated answer, scores, agreement")
def eval_serve(
    small_url,
    large_url,
    small_model,
    large_model,
    tokenizer_spec,
    tasks,
    context_tokens,
    limit,
    seed,
    agreement_tokens,
    timeout,
    output_format,
    output_path,
    log_samples,
):
    """Score a running `kvhub serve` pair over HTTP on the long-context tasks of `kvhub eval`.

    \b
    kvhub serve REF --kvstore-dir /dev/shm/kvhub --json     # prints both URLs
    kvhub eval-serve --small http://127.0.0.1:8001/v1 --large http://127.0.0.1:8002/v1 \\
        --task facts --context-tokens 1024 --limit 30

    Facts: each item is sent, greedy and one request at a time, first to the small server under a fresh
    cache_salt (`source`: its answer; the server stores the prompt's KV), then to the large one: under
    another fresh salt (`own`: its own prefill), under the item's salt (`mapped`: the stored KV mapped,
    the escalation), under the item's salt with kv_transfer_params {"kvhub_control": true} (`control`:
    the no-information control map), and the last 32 prompt tokens alone under a fresh salt (`floor`).

    An answer is exact when the first len(answer) generated tokens are the answer's.  `recomputed %` is
    what the large server reports for the mapped requests; the agreement column is the median count of
    leading greedy tokens (of --agreement-tokens) that mapped and control share with own.  Served scores
    carry no log-likelihood.

    Gist: the small server stores the prompt's KV; the large one answers from its own prefill (`own`, 48
    tokens, with their log-probabilities), then is made to generate that same answer under the item's
    salt (`mapped`), with the control map (`control`) and after the last 32 prompt tokens (`floor`); its
    log-probabilities of the forced tokens are the teacher-forced score (kvhub.serving.forced: the
    servers `kvhub serve` starts force tokens; others refuse with a line saying so).  Gap closed =
    (floor - mapped) / (floor - own) of the mean NLL per token.

    Turns: a three-turn conversation, one fact asked per turn, escalated at turn 1; per turn, a timed
    1-token request (time to first token) and the answer, in five arms: the large server alone (`own`,
    its prefix cache reused between turns), the escalation with later turns sent to the large server only
    (`mapped`), every turn relayed through the small server first (`relay`), turn 1 settled into the
    large server's prefix cache by its own prefill (`settled`, kvhub_prefill), and the control map
    (`control`).  docs/eval-serve.md says what each arm sends.

    `--json` prints `kvhub eval`'s results document (one entry per task and
    length; config names both servers and models); docs/eval-serve.md lists its keys.
    """
    from kvhub.eval.results import document, now, write
    from kvhub.eval.served import Endpoint, base_url
    from kvhub.eval.served_conditions import ServedConditions

    if log_samples and output_path is None:
        raise ConfigError("--log-samples writes the items beside the results: add --output-path PATH")
    if output_path is not None:
        from kvhub.cli.eval_cmd import _probe_output_path

        _probe_output_path(output_path)  # before the run, not after it
    small_url, large_url = base_url(small_url, option="--small"), base_url(large_url, option="--large")
    small = Endpoint.at(small_url, model=small_model, timeout=timeout)
    large = Endpoint.at(large_url, model=large_model, timeout=timeout)
    tokenizer = _tokenizer(tokenizer_spec, small.model)
    results, datasets, samples, stopped = _evaluate(
        ServedConditions(small, large, tokenizer, agreement_tokens=agreement_tokens),
        tasks,
        context_tokens=context_tokens,
        limit=limit,
        seed=seed,
        log_samples=log_samples,
    )
    config = {
        "model": "kvhub-serve",
        "mapper": None,  # the servers do not say which mapper version they run
        "small": {"url": small.url, "model": small.model},
        "large": {"url": large.url, "model": large.model},
        "tokenizer": tokenizer_spec or small.model,
        "limit": limit,
        "seed": seed,
        "agreement_tokens": agreement_tokens,
        "tasks": list(tasks),
        "context_tokens": list(context_tokens),
        "datasets": datasets,
        "date": now(),
        **({"stopped": {"task": stopped[0], "error": str(stopped[1])}} if stopped else {}),
    }
    doc = document(f"{small.model}:{large.model}", results, config)
    if output_path is not None:
        for path in write(doc, samples if log_samples else None, output_path):
            say(f"wrote {path}")
    if output_format == "json":
        click.echo(json.dumps(doc, indent=2))
    else:
        from kvhub.cli.eval_tables import print_gist, print_served, print_turns

        gist = {name: r for name, r in results.items() if "gap_closed_mapped" in r}
        turns = {name: r for name, r in results.items() if r.get("task") in SERVED_TURN_TASKS}
        recall = {name: r for name, r in results.items() if name not in gist and name not in turns}
        if recall:
            print_served(
                f"{small.model} -> {large.model}: exact answers from long contexts, served",
                recall,
                output_format=output_format,
            )
        if gist:
            print_gist(f"{small.model} -> {large.model}, served", gist, output_format=output_format)
        if turns:
            print_turns(f"{small.model} -> {large.model}: turns after an escalation, served", turns, output_format)
    if stopped:  # what was scored is out; the run still fails with the error that stopped it
        say(f"stopped at {stopped[0]}; the results above are of the tasks finished before it", label="note:")
        raise stopped[1]


def _finite(value: float) -> float:
    if not math.isfinite(value):  # FloatRange lets NaN through
        raise click.BadParameter(f"{value} is not a number of seconds; give one like 600", param_hint="'--timeout'")
    return value


def _check_transfers(summary: dict, large_url: str, name: str) -> None:
    """Refuse a run whose `mapped` requests all went unmapped (the column would be the large model's own
    prefill under another name); say so when only some did."""
    from kvhub.errors import ServeError

    reported, items = summary["transfers_reported"], summary["n"]
    if items and not reported:
        raise ServeError(
            f"{large_url} reported no kvhub transfer for any of {name}'s {items} mapped requests, so "
            "`mapped` would be its own prefill: start the pair with `kvhub serve` (the large server needs "
            "kvhub's KV connector, and the small one must store the prompts)"
        )
    if reported < items:
        say(
            f"{name}: {items - reported} of {items} mapped requests reported no kvhub transfer (fell back to "
            "prefill); `mapped` mixes mapped and own answers",
            label="warning:",
            style="yellow",
        )


def _turn_one(summary: dict) -> dict:
    """A turns summary as :func:`_check_transfers` reads one: turn 1's mapped requests and how many loaded."""
    return {"n": summary["n"], "transfers_reported": summary["n"] - summary.get("unmapped_mapped_t1", 0)}


def _tokenizer(spec: str | None, small_model: str):
    """``--tokenizer``, else the small server's model name, read as `kvhub calib build` reads a tokenizer."""
    from kvhub.cli.calib_cmd import load_tokenizer

    try:
        return load_tokenizer(spec or small_model)
    except ConfigError as exc:
        if spec is not None:
            raise
        raise ConfigError(f"{exc}; or name the small server's tokenizer with --tokenizer") from exc


def _evaluate(conditions, tasks, *, context_tokens, limit: int, seed: int, log_samples: bool):
    """(results, data sets, per-item records) by ``task-length``: the registered tasks (:mod:`kvhub.eval.catalog`)
    through :func:`kvhub.eval.run.evaluate`, the loop ``kvhub eval`` runs, over the served pair; a task whose
    mapped requests went unmapped stops the run (:func:`_check_transfers`).  A task that fails ends the run
    there: its name and error come back last (else None), beside what the tasks before it scored.  An error
    before any task finished is raised."""
    from kvhub.cli.progress import progress_callback
    from kvhub.errors import KVHubError
    from kvhub.eval.run import Evaluation, RunSettings, build_tasks, evaluate

    def check(task, outcome) -> None:
        summary = outcome.summaries[""]
        reported = summary if "transfers_reported" in summary else _turn_one(summary)
        _check_transfers(reported, conditions.large.url, task.name)

    task_list = build_tasks(tasks, conditions, limit=limit, seed=seed, context_tokens=context_tokens)
    for task in task_list:  # every task's prompts checked against the servers' lengths before the first request
        task.items()
    settings = RunSettings(None, None, seed=seed, limit=limit, log_samples=log_samples)
    run = Evaluation()
    for task in task_list:
        try:
            one = evaluate(
                [task], [None], settings=settings, progress=lambda: progress_callback("items/s"), check=check
            )
        except KVHubError as exc:
            if not run.results:
                raise
            return run.results, run.datasets, run.samples, (task.name, exc)
        run.results.update(one.results)
        run.datasets.update(one.datasets)
        run.samples.update(one.samples)
    return run.results, run.datasets, run.samples, None


def attach(group: click.Group) -> None:
    """Register eval-serve on the ``kvhub`` group."""
    group.add_command(eval_serve)
