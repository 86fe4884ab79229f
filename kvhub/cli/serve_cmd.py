"""``kvhub serve``: a cascade's two OpenAI-compatible vLLM servers, joined by the kvhub connector.

The small (source) model's server stores each prompt's KV (kv_producer); the large (target) model's
server maps it with the mapper (kv_consumer).  The configuration and command lines come from
:mod:`kvhub.serving.launch`, as for docs/serving.md and benchmarks/vllm_ttft.py.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
from pathlib import Path

import click

from kvhub.cli.console import console, say
from kvhub.cli.options import db_option
from kvhub.cli.output import format_option
from kvhub.core.deshrink import DESHRINK, DESHRINK_DEFAULT
from kvhub.errors import ConfigError
from kvhub.serving.spec import SERVING_SELECTORS

_SMALL, _LARGE = "small", "large"


class _ServeCommand(click.Command):
    """Everything after the first ``--`` goes to both ``vllm serve`` command lines, unparsed."""

    def parse_args(self, ctx, args):
        if "--" in args:
            cut = args.index("--")
            args, ctx.meta["vllm_args"] = args[:cut], tuple(args[cut + 1:])
        return super().parse_args(ctx, args)

    def collect_usage_pieces(self, ctx):
        return [*super().collect_usage_pieces(ctx), "[-- VLLM_ARGS...]"]


@click.command(cls=_ServeCommand)
@click.argument("ref", required=False)
@click.option("--src", default=None, help="Source (small) model id, instead of REF.")
@click.option("--dst", default=None, help="Target (large) model id, instead of REF.")
@click.option("--calib", default=None, help="Calibration-set name, with --src/--dst (when the pair has several).")
@click.option("--kvstore-dir", default=None, type=click.Path(file_okay=False, path_type=Path),
              help="The shared KV store directory, created with mode 700 (default: /dev/shm/kvhub-$USER, shared "
                   "memory private to you; the temp dir where there is no /dev/shm).")
@click.option("--port-small", type=click.IntRange(1, 65535), default=8001, show_default=True,
              help="Port of the small model's server.")
@click.option("--port-large", type=click.IntRange(1, 65535), default=8002, show_default=True,
              help="Port of the large model's server.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address both servers listen on.")
@click.option("--small-model", default=None, metavar="PATH",
              help="What the small server loads (default: the mapper's source model; a model `kvhub fetch "
                   "models` fetched is served from its local copy).")
@click.option("--large-model", default=None, metavar="PATH", help="What the large server loads (same default rule).")
@click.option("--vllm", "vllm_executable", default=None, metavar="PATH",
              help="The vllm executable (default: $KVHUB_VLLM, else `vllm` on PATH, else .venv-vllm/bin/vllm).")
@db_option
@click.option("--hub-repo", "--repo", "hub_repo", default=None, metavar="OWNER/NAME",
              help="Hub repository to fall back to (kvhub.load); --repo is the same option (push's name).")
@click.option("--exact-prefix", type=click.IntRange(min=0), default=None,
              help="First prompt tokens the large model recomputes over the mapped cache (4).")
@click.option("--exact-suffix", type=click.IntRange(min=1), default=None,
              help="Last prompt tokens the large model always computes itself (16; more to reach a block bound).")
@click.option("--exact-budget", type=click.FloatRange(0, 1), default=None,
              help="Fraction of the prompt, in whole sentences / lines, the large model recomputes over the mapped "
                   "cache (0.08; 0 maps only).")
@click.option("--select", type=click.Choice(SERVING_SELECTORS), default=None,
              help="How --exact-budget chooses: the small model's attention, stored with its KV by the small server "
                   "(source, the default; target for an entry stored without it), the large model's attention from "
                   "the prompt's last tokens over the mapped cache (target), or random spans, the no-information "
                   "control.")
@click.option("--queries", type=click.IntRange(min=1), default=None,
              help="Last prompt tokens whose attention scores the context for --select target or source (16).")
@click.option("--deshrink", type=click.Choice(DESHRINK), default=None,
              help=f"How the large server reads the maps: de-shrunk keys and values (kv), values only (v), or as "
                   f"fitted (off) (default $KVHUB_DESHRINK, else {DESHRINK_DEFAULT}, where the mapper stores its "
                   "calibration means).")
@click.option("--min-escalation-tokens", type=click.IntRange(min=0), default=None, metavar="N",
              help="The large server prefills a prompt of fewer tokens itself instead of loading the small server's "
                   "KV; its response says fallback: prefill (256; 0 escalates every prompt; tune it with "
                   "benchmarks/vllm_ttft.py).")
@click.option("--kv-cache-gib", type=click.IntRange(min=1), default=None,
              help="KV cache of each vLLM CPU engine in GiB (VLLM_CPU_KVCACHE_SPACE; default: sized so both engines "
                   "fit this host's memory, or $VLLM_CPU_KVCACHE_SPACE when set).")
@click.option("--kvstore-max-bytes", type=click.IntRange(min=1), default=None,
              help="Size cap of the KV store, LRU eviction (1 GiB).")
@click.option("--require-isolation-key", is_flag=True,
              help="Store and load only requests with a cache_salt (the tenant).")
@click.option("--events", "events_path", default=None, type=click.Path(dir_okay=False),
              help="Append the connectors' decisions here, one JSON line each.")
@click.option("--log-dir", default=None, type=click.Path(file_okay=False, path_type=Path),
              help="Where the servers' logs go (default: a new temporary directory).")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=900, show_default=True,
              help="Seconds to wait for both servers to answer /v1/models.")
@click.option("--dry-run", is_flag=True, help="Print the commands (shell-quoted) and exit.")
@format_option
@click.pass_context
def serve(ctx, ref, src, dst, calib, kvstore_dir, port_small, port_large, host, small_model, large_model,
          vllm_executable, db, hub_repo, exact_prefix, exact_suffix, exact_budget, select, queries, deshrink,
          min_escalation_tokens, kv_cache_gib, kvstore_max_bytes, require_isolation_key, events_path, log_dir, timeout,
          dry_run, output_format):
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
    mapper_ref, source_id, target_id = _resolve_mapper(ref, src, dst, calib, db=db, hub_repo=hub_repo,
                                                       deshrink=deshrink)
    launcher = _launcher(vllm_executable, dry_run=dry_run)
    if events_path is not None:
        from kvhub.serving.connector_config import events_file

        events_file(events_path, option="--events")  # before any server starts
    db_on_command_line, db_env = _db_channel(_absolute_db(db))
    kvstore_dir = kvstore_dir if kvstore_dir is not None else default_kvstore_dir()
    configs = launch.transfer_configs(
        kvstore_dir=kvstore_dir.expanduser().absolute(), source_model=source_id, mapper=mapper_ref,
        db=db_on_command_line, hub_repo=hub_repo, exact_prefix=exact_prefix, exact_suffix=exact_suffix,
        exact_budget=exact_budget, select=select, queries=queries, deshrink=deshrink,
        kvstore_max_bytes=kvstore_max_bytes, min_escalation_tokens=min_escalation_tokens,
        require_isolation_key=require_isolation_key or None,
        events_path=None if events_path is None else os.path.abspath(events_path))
    extra = ctx.meta.get("vllm_args", ())
    plan = {
        _SMALL: dict(model=small_model or _model_path(source_id), served_model_name=source_id, port=port_small,
                     role="producer"),
        _LARGE: dict(model=large_model or _model_path(target_id), served_model_name=target_id, port=port_large,
                     role="consumer"),
    }
    for p in plan.values():
        check_served_model(p["model"])  # hybrid (linear-attention, Mamba) layers: refused by their type
    commands = {name: launch.server_command(launcher, model=p["model"], served_model_name=p["served_model_name"],
                                            host=host, port=p["port"], transfer_config=configs[p["role"]],
                                            extra_args=extra)
                for name, p in plan.items()}
    env = {**_engine_env(kv_cache_gib, models=[p["model"] for p in plan.values()]), **db_env}
    if dry_run:
        _print_dry_run(commands, launcher=launcher, env=_masked(env),
                       kvstore_dir=configs["producer"]["kv_connector_extra_config"]["kvstore_dir"],
                       mapper_ref=mapper_ref, output_format=output_format)
        return
    launch.check_port_free(host, port_small, option="--port-small")
    launch.check_port_free(host, port_large, option="--port-large")
    _make_kvstore_dir(kvstore_dir.expanduser())
    logs = _log_dir(log_dir)
    servers = [launch.Server(name, commands[name], launch.base_url(host, p["port"]), p["served_model_name"],
                             logs / f"{name}.log") for name, p in plan.items()]
    _run(launch.ServerPair(servers, env={**os.environ, **env}), models=[p["model"] for p in plan.values()], timeout=timeout,
         mapper_ref=mapper_ref, as_json=output_format == "json")


def default_kvstore_dir() -> Path:
    """``/dev/shm/kvhub-<user>`` (the temp dir in place of /dev/shm where there is none): one per user, so two
    users of a machine never share a KV store by default."""
    import getpass
    import tempfile

    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no login name (a container's bare uid)
        user = str(os.getuid())
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return root / f"kvhub-{user}"


def _resolve_mapper(ref, src, dst, calib, *, db, hub_repo, deshrink=None) -> tuple[str, str, str]:
    """(the version's full reference, source model id, target model id); kvhub.load's errors otherwise, among
    them --deshrink kv/v on a mapper without target means (the consumer would fail at start)."""
    from kvhub.store.refs import SYNTAX_HELP, Ref

    version = alias = None
    if ref is not None and (src or dst or calib):
        raise ConfigError("name the mapper once: REF, or --src/--dst (and --calib), not both")
    if ref is not None:
        parsed = Ref.parse(ref)
        src, dst, calib, version, alias = parsed.source, parsed.target, parsed.calibration, parsed.version, parsed.alias
    elif not (src and dst):
        raise ConfigError(f"name the mapper to serve: REF or --src and --dst; {SYNTAX_HELP}. `kvhub list` "
                          "shows the store's mappers")
    from kvhub.api import load

    mapper = load(src, dst, calib=calib, version=version, alias=alias, hub_repo=hub_repo, db=db, device="cpu",
                  deshrink=deshrink)
    return mapper.ref, mapper.source["model_id"], mapper.target["model_id"]


def _launcher(option, *, dry_run: bool) -> list[str]:
    """How to run vllm (launch.vllm_launcher); for --dry-run, ``vllm`` (with a note) when none is installed."""
    from kvhub.errors import NotFoundError
    from kvhub.serving.launch import find_vllm, vllm_launcher

    try:
        return vllm_launcher(find_vllm(option))
    except NotFoundError as missing:
        if not dry_run:
            raise
        say(f"{missing}; the commands below say `vllm`", label="note:")
        return ["vllm"]


def _shown(word: str) -> str:
    """A path under the working directory relative to it, as docs show it."""
    try:
        return str(Path(word).relative_to(Path.cwd())) if Path(word).is_absolute() else word
    except ValueError:
        return word


def _model_path(model_id: str) -> str:
    """The local copy of a model `kvhub fetch models` fetched, else the id itself (vLLM resolves it)."""
    from kvhub.models.loading import resolve_model_path

    return str(resolve_model_path(model_id))


def _absolute_db(db: str | None) -> str | None:
    """A store path as the servers get it: absolute, so the printed commands work from any directory (a URL
    stays as it is)."""
    if not db or "://" in db:
        return db
    return os.path.abspath(os.path.expanduser(db))


def _db_channel(db: str | None) -> tuple[str | None, dict[str, str]]:
    """(--db for the consumer's kv_transfer_config, environment for the servers): a store URL that holds a
    password travels as KVHUB_DB_URL in the servers' environment, never on a command line (``ps`` shows those)."""
    from urllib.parse import urlsplit

    try:
        password = urlsplit(db).password if db and "://" in db else None
    except ValueError:
        password = None
    if not password:
        return db, {}
    say("the store URL holds a password: it reaches the large server as KVHUB_DB_URL in its environment, not on "
        "its command line")
    return None, {"KVHUB_DB_URL": db}


def _masked(env: dict[str, str]) -> dict[str, str]:
    """``env`` with a store URL's password shown as ***."""
    from urllib.parse import urlsplit

    if "KVHUB_DB_URL" not in env:
        return env
    url = env["KVHUB_DB_URL"]
    password = urlsplit(url).password
    return {**env, "KVHUB_DB_URL": url.replace(f":{password}@", ":***@", 1)}


def _engine_env(kv_cache_gib: int | None, *, models: list[str]) -> dict[str, str]:
    """The environment both engines get on top of this one: each CPU engine's KV cache size, so that two fit
    one host (vLLM's default reserves most of its memory for one); said on stderr."""
    from kvhub.serving import launch

    if kv_cache_gib is None and os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        say(f"each CPU engine's KV cache: {os.environ['VLLM_CPU_KVCACHE_SPACE']} GiB ($VLLM_CPU_KVCACHE_SPACE)")
        return {}
    if kv_cache_gib is None:
        total = launch.host_memory_gib()
        kv_cache_gib = launch.cpu_kv_cache_gib(total_gib=total, weights_gib=[launch.weights_gib(m) for m in models])
        say(f"each CPU engine's KV cache: {kv_cache_gib} GiB, so both engines fit this host's {total:.0f} GiB "
            "(--kv-cache-gib to change; ignored by GPU engines, which take --gpu-memory-utilization after --)")
    return {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}


def _print_dry_run(commands: dict[str, list[str]], *, launcher: list[str], env: dict[str, str], kvstore_dir: str,
                   mapper_ref: str, output_format: str = "table") -> None:
    """The commands kvhub serve would run: shell lines, or (json, tsv) one record per server with its
    environment and argv, for scripts."""
    if output_format in ("json", "tsv"):
        from kvhub.cli.output import echo_json, print_table

        shown = {name: [*map(_shown, command[:len(launcher)]), *command[len(launcher):]]
                 for name, command in commands.items()}
        if output_format == "json":
            echo_json({"ref": mapper_ref, "kvstore_dir": kvstore_dir, "env": env,
                       "servers": {name: {"argv": argv, "command": shlex.join(argv)} for name, argv in shown.items()}})
        else:
            print_table(["server", "env", "command"],
                        [[name, " ".join(f"{k}={v}" for k, v in env.items()), shlex.join(argv)]
                         for name, argv in shown.items()], output_format="tsv")
        return
    click.echo(f"# kvhub serve, mapper {mapper_ref}: run each server in its own terminal")
    click.echo(shlex.join(["mkdir", "-p", "-m", "700", kvstore_dir]))
    for name, role in ((_SMALL, "kv_producer: stores each prompt's KV"), (_LARGE, "kv_consumer: maps it")):
        command = commands[name]
        click.echo(f"# {name} model, {role}")
        assignments = [f"{key}={value}" for key, value in env.items()]
        click.echo(shlex.join([*assignments, *map(_shown, command[:len(launcher)]), *command[len(launcher):]]))


def _make_kvstore_dir(path: Path) -> None:
    """Create the KV store directory private to this user; warn when an existing one is open to others."""
    if path.is_dir():
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            say(f"the KV store directory {path} is open to other users (mode {mode:o}); it holds every tenant's "
                f"prompts' KV: `chmod 700 {shlex.quote(str(path))}`", label="warning:", style="yellow")
        return
    try:
        path.mkdir(mode=0o700, parents=True)
        path.chmod(0o700)  # mkdir's mode is filtered by the umask
    except OSError as exc:
        raise ConfigError(f"cannot create the KV store directory {path}: {exc.strerror}; pick another --kvstore-dir") \
            from exc


def _log_dir(option: Path | None) -> Path:
    import tempfile

    if option is None:
        return Path(tempfile.mkdtemp(prefix="kvhub-serve-"))
    option.expanduser().mkdir(parents=True, exist_ok=True)
    return option.expanduser()


def _run(pair, *, models: list[str], timeout: float, mapper_ref: str, as_json: bool) -> None:
    """Start both servers, report them when ready, and serve until a signal or a server's exit."""
    from kvhub.cli.progress import progress_callback

    previous = {signum: signal.signal(signum, pair.request_stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pair:
            for server, model in zip(pair.servers, models):
                say(f"starting the {server.name} server: {server.served_model_name} ({model}) at {server.url}, "
                    f"log {server.log_path}")
            pair.start()
            with progress_callback(unit="servers/s") as progress:
                ready = pair.wait_ready(timeout=timeout, progress=progress)
            if ready:
                _report_ready(pair, mapper_ref=mapper_ref, as_json=as_json)
                pair.wait()
            name = signal.Signals(pair.stop_signal).name
            say(f"{name}: stopping both servers")
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    say("both servers stopped")


def _report_ready(pair, *, mapper_ref: str, as_json: bool) -> None:
    small, large = pair.servers
    if as_json:
        click.echo(json.dumps({"mapper": mapper_ref, **{
            server.name: {"url": server.url, "model": server.served_model_name, "pid": server.process.pid,
                          "log": str(server.log_path)} for server in pair.servers}}, sort_keys=True))
    else:
        say(f"small  {small.url}  {small.served_model_name}  (kv_producer)", to=console)
        say(f"large  {large.url}  {large.served_model_name}  (kv_consumer, mapper {mapper_ref})", to=console)
    body = json.dumps({"model": large.served_model_name, "messages": [{"role": "user", "content": "..."}],
                       "cache_salt": "tenant-1"})
    say(f"to escalate a conversation, send the large server the messages and cache_salt it had on the small one:\n"
        f"  curl -s {large.url}/chat/completions -H 'Content-Type: application/json' -d '{body}'\n"
        "Ctrl-C stops both servers.")


def attach(group: click.Group) -> None:
    """Register serve on the ``kvhub`` group."""
    group.add_command(serve)
