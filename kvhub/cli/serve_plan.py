"""What ``kvhub serve`` does around its command line: resolving the mapper to ids, the vLLM launcher, the store's
channel to the servers, the engine environment, the dry run's report, and running the pair until it stops."""

from __future__ import annotations

import json
import os
import shlex
import signal
from pathlib import Path

import click

from kvhub.cli.console import console, say
from kvhub.errors import ConfigError

_SMALL, _LARGE = "small", "large"  # the two servers' names (log files, reports)
_ROLES = {_SMALL: "source", _LARGE: "target"}  # each server's model: the mapper's fingerprint of that role


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


def _resolve_mapper(ref, src, dst, calib, *, db, hub_repo, deshrink=None, served=None) -> tuple[str, str, str]:
    """(the version's full reference, source model id, target model id), asked of :func:`kvhub.api.resolve`
    without loading the mapper (the large server loads it); its errors otherwise, among them --deshrink kv/v on
    a mapper without target means (the consumer would fail at start), read from the tensor file's header.
    Checks against mapper.json's fingerprints the models served instead of the mapper's own (``served``:
    ``{server name: (option, model)}``, IncompatibleError naming both), and warns of head sizes vLLM's CPU
    engines cannot serve."""
    from kvhub.api import resolve
    from kvhub.artifact.directory import read_metadata
    from kvhub.serving.engine_limits import check_served_models
    from kvhub.store.refs import SYNTAX_HELP, Ref

    if ref is not None and (src or dst or calib):
        raise ConfigError("name the mapper once: REF, or --src/--dst (and --calib), not both")
    if ref is None and not (src and dst):
        raise ConfigError(
            f"name the mapper to serve: REF or --src and --dst; {SYNTAX_HELP}. `kvhub list` shows the store's mappers"
        )
    found = resolve(ref if ref is not None else Ref.of(src, dst, calibration=calib), db=db, hub_repo=hub_repo)
    if found.ref is None:
        raise ConfigError(
            f"{ref} is an artifact directory no store version holds; `kvhub import` it, then serve its reference"
        )
    found.deshrink_setting(deshrink)
    metadata = read_metadata(found.directory)
    check_served_models(metadata, {name: given for name, given in (served or {}).items() if given[1]})
    _warn_cpu_head_sizes(metadata)
    return found.ref, found.source_id, found.target_id


def _warn_cpu_head_sizes(metadata: dict) -> None:
    """Said before the minutes of start-up: a CPU engine (no GPU here) of an unsupported head size fails at
    its first request (:func:`kvhub.serving.engine_limits.cpu_head_size_warning`)."""
    import torch

    from kvhub.serving.engine_limits import cpu_head_size_warning

    if torch.cuda.is_available():
        return
    warning = cpu_head_size_warning(
        {name: (metadata[role]["model_id"], metadata[role].get("head_dim")) for name, role in _ROLES.items()}
    )
    if warning:
        say(warning, label="warning:", style="yellow")


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
    say(
        "the store URL holds a password: it reaches the large server as KVHUB_DB_URL in its environment, not on "
        "its command line"
    )
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
        say(
            f"each CPU engine's KV cache: {kv_cache_gib} GiB, so both engines fit this host's {total:.0f} GiB "
            "(--kv-cache-gib to change; ignored by GPU engines, which take --gpu-memory-utilization after --)"
        )
    return {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}


def _print_dry_run(
    commands: dict[str, list[str]],
    *,
    launcher: list[str],
    env: dict[str, str],
    kvstore_dir: str,
    mapper_ref: str,
    output_format: str = "table",
) -> None:
    """The commands kvhub serve would run: shell lines, or (json, tsv) one record per server with its
    environment and argv, for scripts."""
    if output_format in ("json", "tsv"):
        from kvhub.cli.output import echo_json, print_table

        shown = {
            name: [*map(_shown, command[: len(launcher)]), *command[len(launcher) :]]
            for name, command in commands.items()
        }
        if output_format == "json":
            echo_json(
                {
                    "ref": mapper_ref,
                    "kvstore_dir": kvstore_dir,
                    "env": env,
                    "servers": {name: {"argv": argv, "command": shlex.join(argv)} for name, argv in shown.items()},
                }
            )
        else:
            print_table(
                ["server", "env", "command"],
                [
                    [name, " ".join(f"{k}={v}" for k, v in env.items()), shlex.join(argv)]
                    for name, argv in shown.items()
                ],
                output_format="tsv",
            )
        return
    click.echo(f"# kvhub serve, mapper {mapper_ref}: run each server in its own terminal")
    click.echo(shlex.join(["mkdir", "-p", "-m", "700", kvstore_dir]))
    for name, role in ((_SMALL, "kv_producer: stores each prompt's KV"), (_LARGE, "kv_consumer: maps it")):
        command = commands[name]
        click.echo(f"# {name} model, {role}")
        assignments = [f"{key}={value}" for key, value in env.items()]
        click.echo(shlex.join([*assignments, *map(_shown, command[: len(launcher)]), *command[len(launcher) :]]))


def _make_kvstore_dir(path: Path) -> None:
    """Create the KV store directory private to this user; warn when an existing one is open to others."""
    if path.is_dir():
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            say(
                f"the KV store directory {path} is open to other users (mode {mode:o}); it holds every tenant's "
                f"prompts' KV: `chmod 700 {shlex.quote(str(path))}`",
                label="warning:",
                style="yellow",
            )
        return
    try:
        path.mkdir(mode=0o700, parents=True)
        path.chmod(0o700)  # mkdir's mode is filtered by the umask
    except OSError as exc:
        raise ConfigError(
            f"cannot create the KV store directory {path}: {exc.strerror}; pick another --kvstore-dir"
        ) from exc


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
                say(
                    f"starting the {server.name} server: {server.served_model_name} ({model}) at {server.url}, "
                    f"log {server.log_path}"
                )
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
        click.echo(
            json.dumps(
                {
                    "mapper": mapper_ref,
                    **{
                        server.name: {
                            "url": server.url,
                            "model": server.served_model_name,
                            "pid": server.process.pid,
                            "log": str(server.log_path),
                        }
                        for server in pair.servers
                    },
                },
                sort_keys=True,
            )
        )
    else:
        say(f"small  {small.url}  {small.served_model_name}  (kv_producer)", to=console)
        say(f"large  {large.url}  {large.served_model_name}  (kv_consumer, mapper {mapper_ref})", to=console)
    body = json.dumps(
        {"model": large.served_model_name, "messages": [{"role": "user", "content": "..."}], "cache_salt": "tenant-1"}
    )
    say(
        f"to escalate a conversation, send the large server the messages and cache_salt it had on the small one:\n"
        f"  curl -s {large.url}/chat/completions -H 'Content-Type: application/json' -d '{body}'\n"
        "Ctrl-C stops both servers."
    )
