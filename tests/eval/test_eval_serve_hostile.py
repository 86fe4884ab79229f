"""``kvhub eval-serve`` against servers that misbehave (reliability-3 R3-2 .. R3-5, R3-8): every answer that
cannot be a vLLM completion is a one-line ServeError naming the URL, never a traceback, a hang or a score.

One in-process stub answers ``GET /v1/models`` and ``POST /v1/completions``; each table row names how it
misbehaves.  Rows that wait out a deadline are ``slow``.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from click.testing import CliRunner

from kvhub.cli.main import main
from kvhub.errors import ServeError
from kvhub.eval import served
from kvhub.eval.served import Endpoint

NORMAL_EXACT = 3


def save_char_tokenizer(directory) -> None:
    """One token per ASCII character (as tests/eval/test_eval_serve.py's, without its models)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{chr(i): i for i in range(1, 128)}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>").save_pretrained(directory)


def _completion(body: dict, mode: str) -> dict:
    n = body["max_tokens"]
    ids = (body.get("vllm_xargs") or {}).get("kvhub_force") or [65] * n
    ids = {
        "str": ["a"] * n,
        "int": 5,
        "inf": [float("inf")] * n,
        "nan": [float("nan")] * n,
        "big": [2**63] * n,
        "neg": [-1] * n,
        "float": [65.7] * n,
        "bool": [True] * n,
    }.get(mode, ids)
    logprobs = {"poslp": [3.0] * n, "inflp": [float("-inf")] * n, "nanlp": [float("nan")] * n}.get(
        mode, [-1.0 - i / 10 for i in range(n)]
    )
    out = {"choices": [{"text": "A" * n, "token_ids": ids, "logprobs": {"token_logprobs": logprobs}}]}
    exact = {"exact_neg": -100, "exact_huge": 10**9, "exact_bool": True, "exact_float": 2.5}.get(mode, NORMAL_EXACT)
    if mode != "notransfer":
        out["kv_transfer_params"] = {"kvhub": {"exact_tokens": exact, **REPORTS.get(mode, {})}}
    return out


REPORTS = {  # stub mode -> other fields of its kv_transfer_params.kvhub report (the turns task reads them)
    "mapped_text": {"mapped_tokens": "no"},
    "mapped_neg": {"mapped_tokens": -5},
    "mapped_huge": {"mapped_tokens": 10**30},
    "mapped_bool": {"mapped_tokens": True},
    "fallback_false": {"select_fallback": False},
    "fallback_empty": {"select_fallback": ""},
    "fallback_number": {"select_fallback": 1},
    "own": {"mapped_tokens": 36, "select_fallback": "no stored source attention: select=target"},
}


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self.server.requests.append("GET")
        self._reply({"data": [{"id": "m"}]})

    def do_POST(self):
        self.server.requests.append("POST")
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._reply(_completion(body, self.server.mode))

    def _reply(self, obj):
        mode = self.server.mode
        if mode == "endless":  # whitespace forever, no length
            self.send_response(200)
            self.end_headers()
            try:
                while True:
                    self.wfile.write(b" " * 4096)
                    time.sleep(0.01)
            except OSError:
                return
        raw = {
            "deep": b"[" * 100000 + b"]" * 100000,
            "ansi": b"\x1b]0;pwned\x07\x1b[2Jnot json",
            "huge": b" " * (2 << 20) + b"{}",
        }.get(mode) or json.dumps(obj).encode()
        status = 500 if mode == "ansi500" else 200
        if mode == "ansi500":
            raw = json.dumps({"error": {"message": "boom \x1b[2J\x1b]0;pwned\x07"}}).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        step = 4 if mode == "drip" else len(raw)
        try:
            for i in range(0, len(raw), step):
                self.wfile.write(raw[i : i + step])
                self.wfile.flush()
                if mode == "drip":
                    time.sleep(0.3)
        except OSError:
            pass


@pytest.fixture(scope="module")
def stub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    server.mode, server.requests = "normal", []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    yield server
    server.shutdown()


@pytest.fixture
def server(stub):
    stub.mode, stub.requests = "normal", []
    return stub


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("char-tokenizer")
    save_char_tokenizer(directory)
    return directory


def _run(server, tokenizer_dir, *args, timeout=5):
    result = CliRunner().invoke(
        main,
        [
            "eval-serve",
            "--small",
            server.url,
            "--large",
            server.url,
            "--tokenizer",
            str(tokenizer_dir),
            "--task",
            "code",
            "--context-tokens",
            "64",
            "--limit",
            "1",
            "--timeout",
            str(timeout),
            *map(str, args),
        ],
    )
    return result


def _one_line_error(result, code=ServeError.exit_code):
    assert result.exit_code == code, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]  # stderr holds progress too
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert "\x1b" not in result.output and "\x07" not in result.output  # nothing from the server drives the terminal
    return lines[0]


def test_the_stub_itself_is_a_good_server(server, tokenizer_dir):
    result = _run(server, tokenizer_dir, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["results"]["code-64"]["transfers_reported"] == 1


BAD_ANSWERS = [  # (stub mode, what the one-line error says)
    pytest.param("str", "are not token ids", id="R3_2-token-ids-text"),
    pytest.param("int", "are not token ids", id="R3_2-token-ids-not-a-list"),
    pytest.param("inf", "are not token ids", id="R3_2-token-ids-infinity"),
    pytest.param("nan", "are not token ids", id="R3_2-token-ids-nan"),
    pytest.param("big", "are not token ids", id="R3_2-token-id-2-63"),
    pytest.param("neg", "are not token ids", id="R3_2-token-id-negative"),
    pytest.param("float", "are not token ids", id="R3_2-token-id-float-truncated"),
    pytest.param("bool", "are not token ids", id="R3_2-token-id-bool"),
    pytest.param("deep", "nested too deeply", id="R3_2-deep-json"),
    pytest.param("exact_neg", "exact_tokens=-100", id="R3_3-exact-tokens-negative"),
    pytest.param("exact_huge", "exact_tokens=1000000000", id="R3_3-exact-tokens-beyond-prompt"),
    pytest.param("exact_bool", "exact_tokens=true", id="R3_3-exact-tokens-bool"),
    pytest.param("exact_float", "exact_tokens=2.5", id="R3_3-exact-tokens-float"),
    pytest.param("notransfer", "reported no kvhub transfer", id="R3_3-mapped-without-any-transfer"),
    pytest.param(
        "ansi",
        r"answered something that is not JSON: \x1b]0;pwned\x07\x1b[2Jnot json",
        id="R3_8-terminal-escapes-in-body",
    ),
    pytest.param("ansi500", r"answered HTTP 500: boom \x1b[2J\x1b]0;pwned\x07", id="R3_8-terminal-escapes-in-error"),
]


@pytest.mark.parametrize("mode, says", BAD_ANSWERS)
def test_a_malformed_answer_is_one_line(server, tokenizer_dir, mode, says):
    server.mode = mode
    line = _one_line_error(_run(server, tokenizer_dir))
    assert says in line and server.url in line


@pytest.mark.parametrize(
    "mode, says",
    [
        pytest.param("poslp", "not log-probabilities", id="R3_3-positive-logprob"),
        pytest.param("inflp", "not log-probabilities", id="R3_3-infinite-logprob"),
        pytest.param("nanlp", "not log-probabilities", id="R3_3-nan-logprob"),
    ],
)
def test_impossible_log_probabilities_are_refused(server, mode, says):
    """What the gist scores: +3.0 used to give a negative NLL, -inf a null one, both reported with exit 0."""
    server.mode = mode
    with pytest.raises(ServeError, match=says):
        Endpoint(server.url, "m", timeout=5).complete([65] * 40, max_tokens=4, cache_salt="t", logprobs=True)


@pytest.mark.parametrize(
    "mode, says",
    [
        pytest.param("mapped_text", 'mapped_tokens="no" for a prompt of 40 tokens', id="mapped-tokens-text"),
        pytest.param("mapped_neg", "mapped_tokens=-5", id="mapped-tokens-negative"),
        pytest.param("mapped_huge", "mapped_tokens=1000000000000000000000000000000", id="mapped-tokens-huge"),
        pytest.param("mapped_bool", "mapped_tokens=true", id="mapped-tokens-bool"),
        pytest.param("fallback_false", "select_fallback=false", id="select-fallback-bool"),
        pytest.param("fallback_empty", 'select_fallback=""', id="select-fallback-empty"),
        pytest.param("fallback_number", "select_fallback=1", id="select-fallback-number"),
    ],
)
def test_report_fields_a_score_reads_are_checked(server, mode, says):
    """Planted bugs caught: the turns task counting `mapped_tokens` "no", -5 or 10^30 as mapped and a
    `select_fallback` of false as a fallback by truthiness, exit 0 (exact_tokens beside them was checked)."""
    server.mode = mode
    with pytest.raises(ServeError, match="connector is not kvhub's") as refused:
        Endpoint(server.url, "m", timeout=5).complete([65] * 40, max_tokens=4, cache_salt="t")
    assert says in str(refused.value) and server.url in str(refused.value)


def test_the_connectors_own_report_is_read(server):
    """The control: what kvhub's connector sends (a count, a reason text) passes."""
    server.mode = "own"
    done = Endpoint(server.url, "m", timeout=5).complete([65] * 40, max_tokens=4, cache_salt="t")
    assert done.kv_transfer_params["kvhub"]["mapped_tokens"] == 36


def test_R3_5_a_body_past_the_cap_is_refused(server, monkeypatch):
    server.mode = "huge"
    monkeypatch.setattr(served, "MAX_BODY_BYTES", 1 << 20)
    with pytest.raises(ServeError, match=r"answered more than 1 MiB"):
        served.served_models(server.url, timeout=5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode", [pytest.param("drip", id="R3_5-slow-drip"), pytest.param("endless", id="R3_5-endless-stream")]
)
def test_timeout_is_a_deadline_for_the_whole_answer(server, tokenizer_dir, mode):
    server.mode = mode
    started = time.monotonic()
    line = _one_line_error(_run(server, tokenizer_dir, timeout=1.5))
    assert time.monotonic() - started < 10
    assert "did not answer within 1.5 s" in line


BAD_OPTIONS = [  # (options, what the refusal says): exit 2 before any request
    pytest.param(["--timeout", "nan"], "--timeout", id="R3_2-timeout-nan"),
    pytest.param(["--timeout", "inf"], "--timeout", id="R3_2-timeout-inf"),
    pytest.param(["--context-tokens", "100000000"], "--context-tokens", id="R3_2-context-tokens-huge"),
]


@pytest.mark.parametrize("options, says", BAD_OPTIONS)
def test_bad_numbers_are_refused_at_parse_time(server, tokenizer_dir, options, says):
    result = CliRunner().invoke(
        main,
        [
            "eval-serve",
            "--small",
            server.url,
            "--large",
            server.url,
            "--tokenizer",
            str(tokenizer_dir),
            "--task",
            "code",
            *options,
        ],
    )
    assert result.exit_code == 2 and says in result.output, result.output
    assert server.requests == []


def test_R3_8_a_password_in_a_url_is_never_echoed(server, tokenizer_dir):
    url = server.url.replace("://", "://user:s3cret@")
    result = CliRunner().invoke(main, ["eval-serve", "--small", url, "--large", server.url, "--task", "code"])
    assert result.exit_code == 2 and "s3cret" not in result.output and "***@" in result.output, result.output
    assert served.redacted("http://u:p@h:1/v1") == "http://***@h:1/v1" and served.redacted("h/v1") == "h/v1"


@pytest.mark.parametrize(
    "make_path",
    [
        pytest.param(lambda tmp: (tmp / "F").write_text("x") and tmp / "F" / "out.json", id="R3_4-parent-is-a-file"),
        pytest.param(lambda tmp: tmp / "F.txt" if (tmp / "F.txt").write_text("x") else None, id="R3_4-dir-is-a-file"),
        pytest.param(lambda tmp: (tmp / "d.json").mkdir() or tmp / "d.json", id="R3_4-json-is-a-directory"),
        pytest.param(lambda tmp: "/proc/x/out.json", id="R3_4-unwritable"),
    ],
)
def test_R3_4_output_path_is_checked_before_the_run(server, tokenizer_dir, tmp_path, make_path):
    result = _run(server, tokenizer_dir, "--output-path", make_path(tmp_path))
    assert result.exit_code == 2 and "--output-path" in result.output, result.output
    assert server.requests == []  # refused before the first request, not after the whole run
