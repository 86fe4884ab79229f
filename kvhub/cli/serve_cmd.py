"""``kvhub serve``: a cascade's two OpenAI-compatible vLLM servers, joined by the kvhub connector.

The small (source) model's server stores each prompt's KV (kv_producer); the large (target) model's
server maps it with the mapper (kv_consumer).  The configuration and command lines come from
:mod:`kvhub.serving.launch`, as for docs/serving.md and benchmarks/vllm_ttft.py.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import click

from kvhub.cli.options import db_option
from kvhub.cli.output import format_option
from kvhub.cli.serve_plan import (  # noqa: F401  (tests reach these through serve_cmd)
    _LARGE,
    _SMALL,
    _absolute_db,
    _db_channel,
    _engine_env,
    _launcher,
    _log_dir,
    _make_kvstore_dir,
    _masked,
    _model_path,
    _print_dry_run,
    _report_ready,
    _resolve_mapper,
    _run,
    _shown,
    default_kvstore_dir,
)
from kvhub.core.deshrink import DESHRINK, DESHRINK_DEFAULT
from kvhub.errors import ConfigError
from kvhub.serving.spec import SERVING_SELECTORS


class _ServeCommand(click.Command):
    """Everything after the first ``--`` goes to both ``vllm serve`` command lines, unparsed."""

    def parse_args(self, ctx, args):
        if "--" in args:
            cut = args.index("--")
            args, ctx.meta["vllm_args"] = args[:cut], tuple(args[cut + 1 :])
        return super().parse_args(ctx, args)

    def collect_usage_pieces(self, ctx):
        return [*super().collect_usage_pieces(ctx), "[-- VLLM_ARGS...]"]


@click.command(cls=_ServeCommand)
@click.argument("ref", required=False)
@click.option("--src", default=None, help="Source (small) model id, instead of REF.")
@click.option("--dst", default=None, help="Target (large) model id, instead of REF.")
@click.option("--calib", default=None, help="Calibration-set name, with --src/--dst (when the pair has several).")
@click.option(
    "--kvstore-dir",
    default=None,
    type=click.Path(file_okay=False, path_type=Path),
    help="The shared KV store directory, created with mode 700 (default: /dev/shm/kvhub-$USER, shared "
    "memory private to you; the temp dir where there is no /dev/shm).",
)
@click.option(
    "--port-small",
    type=click.IntRange(1, 65535),
    default=8001,
    show_default=True,
    help="Port of the small model's server.",
)
@click.option(
    "--port-large",
    type=click.IntRange(1, 65535),
    default=8002,
    show_default=True,
    help="Port of the large model's server.",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address both servers listen on.")
@click.option(
    "--small-model",
    default=None,
    metavar="PATH",
    help="What the small server loads (default: the mapper's source model; a model `kvhub fetch "
    "models` fetched is served from its local copy); another model of other KV geometry is refused.",
)
@click.option(
    "--large-model",
    default=None,
    metavar="PATH",
    help="What the large server loads (same default rule; the mapper's target model's KV geometry).",
)
@click.option(
    "--vllm",
    "vllm_executable",
    default=None,
    metavar="PATH",
    help="The vllm executable (default: $KVHUB_VLLM, else `vllm` on PATH, else .venv-vllm/bin/vllm).",
)
@db_option
@click.option(
    "--hub-repo",
    "--repo",
    "hub_repo",
    default=None,
    metavar="OWNER/NAME",
    help="Hub repository to fall back to (kvhub.load); --repo is the same option (push's name).",
)
@click.option(
    "--exact-prefix",
    type=click.IntRange(min=0),
    default=None,
    help="First prompt tokens the large model recomputes over the mapped cache (4).",
)
@click.option(
    "--exact-suffix",
    type=click.IntRange(min=1),
    default=None,
    help="Last prompt tokens the large model always computes itself (16; more to reach a block bound).",
)
@click.option(
    "--exact-budget",
    type=click.FloatRange(0, 1),
    default=None,
    help="Fraction of the prompt, in whole sentences / lines, the large model recomputes over the mapped "
    "cache (0.08; 0 maps only).",
)
@click.option(
    "--select",
    type=click.Choice(SERVING_SELECTORS),
    default=None,
    help="How --exact-budget chooses: the small model's attention, stored with its KV by the small server "
    "(source, the default; target for an entry stored without it), the large model's attention from "
    "the prompt's last tokens over the mapped cache (target), or random spans, the no-information "
    "control.",
)
@click.option(
    "--queries",
    type=click.IntRange(min=1),
    default=None,
    help="Last prompt tokens whose attention scores the context for --select target or source (16).",
)
@click.option(
    "--deshrink",
    type=click.Choice(DESHRINK),
    default=None,
    help=f"How the large server reads the maps: de-shrunk keys and values (kv), values only (v), or as "
    f"fitted (off) (default $KVHUB_DESHRINK, else {DESHRINK_DEFAULT}, where the mapper stores its "
    "calibration means).",
)
@click.option(
    "--min-escalation-tokens",
    type=click.IntRange(min=0),
    default=None,
    metavar="N",
    help="The large server prefills a prompt of fewer tokens itself instead of loading the small server's "
    "KV; its response says fallback: prefill (256; 0 escalates every prompt; tune it with "
    "benchmarks/vllm_ttft.py).",
)
@click.option(
    "--kv-cache-gib",
    type=click.IntRange(min=1),
    default=None,
    help="KV cache of each vLLM CPU engine in GiB (VLLM_CPU_KVCACHE_SPACE; default: sized so both engines "
    "fit this host's memory, or $VLLM_CPU_KVCACHE_SPACE when set).",
)
@click.option(
    "--kvstore-max-bytes",
    type=click.IntRange(min=1),
    default=None,
    help="Size cap of the KV store, LRU eviction (1 GiB).",
)
@click.option(
    "--require-isolation-key", is_flag=True, help="Store and load only requests with a cache_salt (the tenant)."
)
@click.option(
    "--events",
    "events_path",
    default=None,
    type=click.Path(dir_okay=False),
    help="Append the connectors' decisions here, one JSON line each.",
)
@click.option(
    "--log-dir",
    default=None,
    type=click.Path(file_okay=False, path_type=Path),
    help="Where the servers' logs go (default: a new temporary directory).",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=900,
    show_default=True,
    help="Seconds to wait for both servers to answer /v1/models.",
)
@click.option("--dry-run", is_flag=True, help="Print the commands (shell-quoted) and exit.")
@format_option
@click.pass_context
def serve(
    ctx,
    ref,
    src,
    dst,
    calib,
    kvstore_dir,
    port_small,
    port_large,
    host,
    small_model,
    large_model,
    vllm_executable,
    db,
    hub_repo,
    exact_prefix,
    exact_suffix,
    exact_budget,
    select,
    queries,
    deshrink,
    min_escalation_tokens,
    kv_cache_gib,
    kvstore_max_bytes,
    require_isolation_key,
    events_path,
    log_dir,
    timeout,
    dry_run,
    output_format,
):
    """Start the small and the large model's OpenAI-compatible vLLM servers, joined by the connector.

    \b
    kvhub serve qwen2.5-coder-0.5b-instruct:qwen2.5-coder-1.5b-instruct:legal-docs@production \\
        --kvstore-dir /dev/shm/kvhub --port-small 8001 --port-large 8002 -- --max-model-len 4096

    REF (or --src/--dst/--calib) names the mapper; it is resolved first (store, then Hub), and the
    large server loads exactly that version.  Both servers run until Ctrl-C or SIGTERM, which is
    passed on to both; if one exits, the other is stopped.  Send a conversation to the small server;
    to escalate it, send the same messages with the same cache_salt to the large one, which maps the
    small server's KV, recomputes the first 4 tokens and 8% of the prompt chosen by the small model's
    attention, stored with its KV (a fact stated once comes back), and prefills only the last tokens itself
    (--exact-prefix/--exact-budget/--select/--exact-suffix; docs/serving.md).  A prompt shorter than
    --min-escalation-tokens (256) is prefilled by the large server instead.

    Arguments after -- go to both `vllm serve` commands.  vLLM runs from its own environment
    (scripts/setup-vllm.sh makes .venv-vllm).  --dry-run prints the commands without starting them.
    """
    from kvhub.serving import launch
    from kvhub.serving.engine_limits import check_parallel_args, check_served_model

    if not math.isfinite(timeout):  # click's FloatRange lets nan and inf through
        raise ConfigError(f"--timeout must be a finite number of seconds, got {timeout}")
    if port_small == port_large:
        raise ConfigError(f"--port-small and --port-large are both {port_small}; give each server its own")
    check_parallel_args(ctx.meta.get("vllm_args", ()))  # tensor / pipeline parallel: refused before anything starts
    for given in (small_model, large_model):  # a hybrid model is refused by its layer type, before its geometry
        if given is not None:
            check_served_model(given)
    mapper_ref, source_id, target_id = _resolve_mapper(
        ref,
        src,
        dst,
        calib,
        db=db,
        hub_repo=hub_repo,
        deshrink=deshrink,
        served={_SMALL: ("--small-model", small_model), _LARGE: ("--large-model", large_model)},
    )
    launcher = _launcher(vllm_executable, dry_run=dry_run)
    if events_path is not None:
        from kvhub.serving.connector_config import events_file

        events_file(events_path, option="--events")  # before any server starts
    db_on_command_line, db_env = _db_channel(_absolute_db(db))
    kvstore_dir = kvstore_dir if kvstore_dir is not None else default_kvstore_dir()
    configs = launch.transfer_configs(
        kvstore_dir=kvstore_dir.expanduser().absolute(),
        source_model=source_id,
        mapper=mapper_ref,
        db=db_on_command_line,
        hub_repo=hub_repo,
        exact_prefix=exact_prefix,
        exact_suffix=exact_suffix,
        exact_budget=exact_budget,
        select=select,
        queries=queries,
        deshrink=deshrink,
        kvstore_max_bytes=kvstore_max_bytes,
        min_escalation_tokens=min_escalation_tokens,
        require_isolation_key=require_isolation_key or None,
        events_path=None if events_path is None else os.path.abspath(events_path),
    )
    extra = ctx.meta.get("vllm_args", ())
    plan = {
        _SMALL: dict(
            model=small_model or _model_path(source_id), served_model_name=source_id, port=port_small, role="producer"
        ),
        _LARGE: dict(
            model=large_model or _model_path(target_id), served_model_name=target_id, port=port_large, role="consumer"
        ),
    }
    for p in plan.values():
        check_served_model(p["model"])  # hybrid (linear-attention, Mamba) layers: refused by their type
    commands = {
        name: launch.server_command(
            launcher,
            model=p["model"],
            served_model_name=p["served_model_name"],
            host=host,
            port=p["port"],
            transfer_config=configs[p["role"]],
            extra_args=extra,
        )
        for name, p in plan.items()
    }
    env = {**_engine_env(kv_cache_gib, models=[p["model"] for p in plan.values()]), **db_env}
    if dry_run:
        _print_dry_run(
            commands,
            launcher=launcher,
            env=_masked(env),
            kvstore_dir=configs["producer"]["kv_connector_extra_config"]["kvstore_dir"],
            mapper_ref=mapper_ref,
            output_format=output_format,
        )
        return
    launch.check_port_free(host, port_small, option="--port-small")
    launch.check_port_free(host, port_large, option="--port-large")
    _make_kvstore_dir(kvstore_dir.expanduser())
    logs = _log_dir(log_dir)
    servers = [
        launch.Server(
            name, commands[name], launch.base_url(host, p["port"]), p["served_model_name"], logs / f"{name}.log"
        )
        for name, p in plan.items()
    ]
    _run(
        launch.ServerPair(servers, env={**os.environ, **env}),
        models=[p["model"] for p in plan.values()],
        timeout=timeout,
        mapper_ref=mapper_ref,
        as_json=output_format == "json",
    )


def attach(group: click.Group) -> None:
    """Register serve on the ``kvhub`` group."""
    group.add_command(serve)
