"""``kvhub eval-serve`` (kvhub.eval.served) against an in-process stand-in for ``kvhub serve``'s two servers.

Each stand-in answers vLLM's ``POST /v1/completions`` and ``GET /v1/models`` with a real tiny transformers
model (greedy, over a character-level tokenizer) and refuses requests that break the client's contract.
The large one emulates the consumer connector with an exact map (FakePair), so every condition has a
known answer: own and mapped write the large model's continuation, control a damaged model's, source the
small model's, floor the large model's from the last 32 tokens.
"""

from __future__ import annotations

import json
import socket
from copy import deepcopy
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from click.testing import CliRunner
from transformers import DynamicCache

from kvhub.cli.main import main
from kvhub.core.capture import cache_kwargs
from kvhub.errors import ConfigError, ServeError
from kvhub.eval import served
from kvhub.eval.longctx import FLOOR_TOKENS, RecallItem
from kvhub.eval.recall_tasks import RecallTask
from kvhub.eval.served import SERVED_CONDITIONS, Completion, Endpoint
from kvhub.eval.served_conditions import ServedConditions, run_served
from tests.tinymodels import make_model

VOCAB = 128  # tinymodels' vocabulary: one token per ASCII character
EXACT_TAIL = 16  # prompt tokens the fake consumer reports as recomputed on a mapped request
ANSWER_TOKENS = 4
AGREEMENT = 12
LAYERS = 2  # fewer than tinymodels' 3: every test here decodes a few hundred tokens
LARGE_NAME = "tiny-large"
PROMPTS = [
    f"Note {i}: the {who} crossed the river at dawn, left the {what} by the mill and walked on to"
    for i, (who, what) in enumerate([("miller", "cart"), ("baker", "basket"), ("weaver", "loom")])
]


def save_char_tokenizer(directory) -> None:
    """One token per ASCII character (id = code point, 0 = unknown), inside the tiny models' vocabulary."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{chr(i): i for i in range(1, VOCAB)}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>").save_pretrained(directory)


def greedy(model, prompt: list[int], count: int) -> list[int]:
    """``count`` greedy tokens after ``prompt``."""
    return decode(model, prompt, count)[0]


@torch.no_grad()
def decode(model, prompt: list[int], count: int, forced: list[int] | None = None) -> tuple[list[int], list[float]]:
    """``count`` tokens after ``prompt`` (greedy, or ``forced``'s while it lasts, as kvhub.serving.forced) and
    the model's log-probability of each, on one CPU thread (tiny models gain nothing from more, and a busy
    machine's thread barriers make two ~20x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cache = DynamicCache()
        logits = model(torch.tensor([prompt]), use_cache=True, **cache_kwargs(model, cache)).logits
        tokens, logprobs = [], []
        for index in range(count):
            logp = torch.log_softmax(logits[0, -1].float(), dim=-1)
            tokens.append(forced[index] if forced is not None and index < len(forced) else int(logp.argmax()))
            logprobs.append(float(logp[tokens[-1]]))
            logits = model(torch.tensor([tokens[-1:]]), use_cache=True, **cache_kwargs(model, cache)).logits
        return tokens, logprobs
    finally:
        torch.set_num_threads(threads)


def damaged(model, *, seed: int = 7):
    """A copy of ``model`` with noise much larger than its weights on every parameter."""
    copy = deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in copy.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator))
    return copy


class FakePair:
    """``kvhub serve``'s two servers, in process.

    small: answers with the small model and stores (cache_salt, prompt), as the producer connector stores
    the prompt's KV.  large: a request that extends a prompt stored under its cache_salt (the longest such
    one, as the consumer connector looks up a stored prefix) is mapped, unless the large model prefilled at
    least as long a prefix itself under that salt (vLLM's prefix cache) or it asks for ``kvhub_prefill``: with an exact map it
    answers as the large model itself and reports ``kv_transfer_params {"kvhub": {"exact_tokens": 16}}``;
    with ``kv_transfer_params.kvhub_control`` it answers with the damaged model (the control map carries no
    information about the context).  Any other request is the large model's own prefill, with no report.
    ``vllm_xargs.kvhub_force`` forces the generated ids while ``forcing`` is on (kvhub serve's logits
    processor); ``logprobs`` returns each generated token's log-probability.
    ``requests`` logs (server, cache_salt, control flag, prompt length) in arrival order.
    """

    def __init__(self, small_model, large_model, control_model, tokenizer, *, small_name: str):
        self.models = {"small": small_model, "large": large_model, "control": control_model}
        self.tokenizer, self.small_name = tokenizer, small_name
        self.stored: set[tuple[str | None, tuple[int, ...]]] = set()
        self.requests: list[tuple[str, str | None, bool, int]] = []
        self.forcing = True
        self.max_model_len: int | None = None  # what GET /v1/models reports, as vLLM does, when set
        self.storing = True  # off: the small server stores nothing (a producer without the connector)
        self.prefilled: set[tuple[str | None, tuple[int, ...]]] = set()  # the large model's own prefills
        self.lock = threading.Lock()
        self.servers = [_start(self, "small", small_name), _start(self, "large", LARGE_NAME)]
        self.small_url, self.large_url = (_url(server) for server in self.servers)

    def answer(self, server: str, body: dict) -> tuple[list[int], list[float], dict | None]:
        salt, prompt = body.get("cache_salt"), tuple(body["prompt"])
        control = bool((body.get("kv_transfer_params") or {}).get("kvhub_control"))
        forced = (body.get("vllm_xargs") or {}).get("kvhub_force") if self.forcing else None
        with self.lock:
            self.requests.append((server, salt, control, len(prompt)))
            report = None
            stored = max((len(p) for s, p in self.stored if s == salt and prompt[: len(p)] == p), default=0)
            # vLLM's own prefix cache: a stored prefix no longer than what the large model prefilled itself loads nothing
            own_hit = max((len(p) for s, p in self.prefilled if s == salt and prompt[: len(p)] == p), default=0)
            if server == "large" and (stored <= own_hit or (body.get("kv_transfer_params") or {}).get("kvhub_prefill")):
                stored = 0
            if server == "small":
                if self.storing:
                    self.stored.add((salt, prompt))
                model = self.models["small"]
            elif not stored:
                model = self.models["large"]
                self.prefilled.add((salt, prompt))
            else:
                model = self.models["control" if control else "large"]
                tail = len(prompt) - stored  # what the connector's engine prefills after the stored prefix
                report = {
                    "kvhub": {
                        "exact_tokens": min(max(EXACT_TAIL, tail), len(prompt)),
                        "mapped_tokens": stored - min(EXACT_TAIL, stored) if tail < EXACT_TAIL else stored,
                        "control": control,
                        "deshrink": "kv",
                        **(
                            {"select_fallback": "an earlier turn's attention: select=target"}
                            if tail > EXACT_TAIL
                            else {}
                        ),
                    }
                }
            return (*decode(model, list(prompt), body["max_tokens"], forced), report)

    def close(self) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()


def _contract_problem(body: dict) -> str | None:
    """What vLLM (or this client's contract) would refuse in a completion request, or None."""
    prompt, salt = body.get("prompt"), body.get("cache_salt")
    if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) and 0 <= t < VOCAB for t in prompt):
        return f"prompt must be a non-empty list of token ids below {VOCAB}"
    if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > 128 or set(salt) & set("@/\\\0")):
        return "Parameter 'cache_salt' must be a non-empty string if provided."
    if not (body.get("temperature") == 0 and body.get("ignore_eos") is True and body.get("return_token_ids") is True):
        return "this client must ask for greedy, ignore_eos and return_token_ids"
    if not isinstance(body.get("max_tokens"), int) or body["max_tokens"] < 1:
        return "max_tokens must be a positive integer"
    if body.get("logprobs") not in (None, 1):
        return "this client asks for logprobs=1 or none"
    return None


def _start(pair: FakePair, server: str, name: str) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def send(self, status: int, data) -> None:
            payload = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def error(self, status: int, message: str) -> None:
            self.send(status, {"error": {"message": message, "type": "BadRequestError", "param": None, "code": status}})

        def do_GET(self):
            if self.path != "/v1/models":
                return self.error(404, "Not Found")
            entry = {"id": name, "object": "model", "owned_by": "vllm"}
            if pair.max_model_len is not None:
                entry["max_model_len"] = pair.max_model_len
            self.send(200, {"object": "list", "data": [entry]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/v1/completions":
                return self.error(404, "Not Found")
            if body.get("model") != name:
                return self.error(404, f"The model `{body.get('model')}` does not exist.")
            problem = _contract_problem(body)
            if problem:
                return self.error(400, problem)
            token_ids, logprobs, report = pair.answer(server, body)
            choice = {
                "index": 0,
                "text": pair.tokenizer.decode(token_ids),
                "token_ids": token_ids,
                "finish_reason": "length",
            }
            if body.get("logprobs") is not None:
                choice["logprobs"] = {"token_logprobs": logprobs, "tokens": [chr(t) for t in token_ids]}
            self.send(
                200,
                {
                    "id": "cmpl-0",
                    "object": "text_completion",
                    "model": name,
                    "choices": [choice],
                    "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(token_ids)},
                    "kv_transfer_params": report,
                },
            )

    http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    http.daemon_threads = True
    threading.Thread(target=http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return http


def _url(server: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}/v1"


# ---- fixtures ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("char-tokenizer")
    save_char_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def models():
    large = make_model(seed=0, num_hidden_layers=LAYERS)
    return {"small": make_model(seed=1, num_hidden_layers=LAYERS), "large": large, "control": damaged(large)}


@pytest.fixture(scope="module")
def module_pair(models, tokenizer, tokenizer_dir):
    # the small server serves the tokenizer's directory by name, so `--tokenizer`'s default finds it
    pair = FakePair(models["small"], models["large"], models["control"], tokenizer, small_name=str(tokenizer_dir))
    yield pair
    pair.close()


@pytest.fixture
def pair(module_pair):
    module_pair.requests.clear()
    return module_pair


@pytest.fixture(scope="module")
def items(models, tokenizer):
    """Hand-made items whose answers are the large model's own greedy continuation (so own must be exact)."""
    out = []
    for index, text in enumerate(PROMPTS):
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        answer = greedy(models["large"], prompt, ANSWER_TOKENS)
        out.append(
            RecallItem(f"hand-{index}", prompt, answer, tokenizer.decode(answer), {"context_tokens": len(prompt)})
        )
    return out


@pytest.fixture(scope="module")
def expected(models, items):
    """Each condition's continuation, computed here from the models directly."""
    rows = []
    for item in items:
        longer = max(ANSWER_TOKENS, AGREEMENT)
        rows.append(
            {
                "own": greedy(models["large"], item.prompt_ids, longer),
                "control": greedy(models["control"], item.prompt_ids, longer),
                "source": greedy(models["small"], item.prompt_ids, ANSWER_TOKENS),
                "floor": greedy(models["large"], item.prompt_ids[-FLOOR_TOKENS:], ANSWER_TOKENS),
            }
        )
    for row, item in zip(rows, items):  # the known answers below need each condition to be told apart
        assert row["own"][:ANSWER_TOKENS] == item.answer_ids and len(item.prompt_ids) > FLOOR_TOKENS
        assert row["control"][:ANSWER_TOKENS] != item.answer_ids and row["source"] != item.answer_ids
    return rows


def _evaluate(pair, tokenizer, items, **options) -> dict:
    small, large = Endpoint(pair.small_url, pair.small_name), Endpoint(pair.large_url, LARGE_NAME)
    conditions = ServedConditions(small, large, tokenizer, agreement_tokens=AGREEMENT)
    return run_served(RecallTask("hand", conditions, context_tokens=64, limit=len(items), items=items), **options)


@pytest.fixture(scope="module")
def scored(module_pair, tokenizer, items):
    """(summary with samples, the requests the stand-in received) of one evaluation of ``items``."""
    module_pair.requests.clear()
    summary = _evaluate(module_pair, tokenizer, items, log_samples=True)
    return summary, list(module_pair.requests)


# ---- known answers -----------------------------------------------------------------------------------
def test_each_condition_is_scored_from_its_own_request(scored, tokenizer, items, expected):
    summary = scored[0]
    assert summary["n"] == len(items)
    assert (summary["acc_own"], summary["acc_mapped"], summary["acc_control"], summary["acc_source"]) == (1, 1, 0, 0)
    floors = [int(row["floor"] == item.answer_ids) for row, item in zip(expected, items)]
    assert summary["acc_floor"] == sum(floors) / len(items)
    assert summary["retention"] == 1 and summary["map_minus_control"] == 1
    control_agreement = sorted(served.leading_agreement(row["control"], row["own"]) for row in expected)
    assert summary["median_agreement_mapped"] == AGREEMENT
    assert summary["median_agreement_control"] == control_agreement[1] < AGREEMENT
    assert summary["transfers_reported"] == len(items) and summary["deshrink"] == "kv"
    fraction = sum(EXACT_TAIL / (len(item.prompt_ids) - 1) for item in items) / len(items)
    assert summary["recomputed_fraction"] == pytest.approx(fraction)
    assert summary["context_tokens"] == sum(len(item.prompt_ids) for item in items) / len(items)
    assert (summary["task"], summary["requested_context_tokens"], summary["agreement_tokens"]) == (
        "hand",
        64,
        AGREEMENT,
    )
    for record, row, item in zip(summary["samples"], expected, items):
        assert record["doc_id"] == item.id and record["gold"] == item.answer
        assert record["prediction"] == {
            "own": item.answer,
            "mapped": item.answer,
            "control": tokenizer.decode(row["control"][:ANSWER_TOKENS]),
            "source": tokenizer.decode(row["source"]),
            "floor": tokenizer.decode(row["floor"]),
        }
        assert record["logprobs"] == {c: 0.0 for c in SERVED_CONDITIONS} and record["recomputed"] == EXACT_TAIL
        assert record["agreement"]["mapped"] == AGREEMENT and record["transfer_reported"]


def test_requests_go_one_at_a_time_small_own_mapped_control_floor(scored, items):
    requests = scored[1]
    assert len(requests) == 5 * len(items)
    salts = []
    for index, item in enumerate(items):
        source, own, mapped, control, floor = requests[5 * index : 5 * index + 5]
        tenant = source[1]
        assert source == ("small", tenant, False, len(item.prompt_ids)) and tenant.startswith(served.TENANT_PREFIX)
        assert own[0] == "large" and own[1] != tenant and not own[2]
        assert mapped == ("large", tenant, False, len(item.prompt_ids))
        assert control == ("large", tenant, True, len(item.prompt_ids))
        assert floor[0] == "large" and floor[1] not in (tenant, own[1]) and floor[3] == FLOOR_TOKENS
        salts += [tenant, own[1], floor[1]]
    assert len(set(salts)) == len(salts)  # no namespace is ever reused


def test_planted_client_bugs_change_the_result(scored, pair, tokenizer, items, monkeypatch):
    """The stand-in can fail: the mapped request without its cache_salt maps nothing, and a control request
    without kvhub_control is just the mapped one again."""
    right = scored[0]
    complete = Endpoint.complete

    def unsalted_mapped(self, prompt_ids, *, max_tokens, cache_salt, kv_transfer_params=None):
        if self.url == pair.large_url and kv_transfer_params is None and (cache_salt, tuple(prompt_ids)) in pair.stored:
            cache_salt = None
        return complete(
            self, prompt_ids, max_tokens=max_tokens, cache_salt=cache_salt, kv_transfer_params=kv_transfer_params
        )

    monkeypatch.setattr(Endpoint, "complete", unsalted_mapped)
    unsalted = _evaluate(pair, tokenizer, items[:2])
    assert right["transfers_reported"] == len(items) and right["recomputed_fraction"] > 0
    assert unsalted["transfers_reported"] == 0 and unsalted["recomputed_fraction"] == 0
    assert unsalted["deshrink"] is None  # no transfer, nothing read

    def unflagged_control(self, prompt_ids, *, max_tokens, cache_salt, kv_transfer_params=None):
        return complete(self, prompt_ids, max_tokens=max_tokens, cache_salt=cache_salt)

    monkeypatch.setattr(Endpoint, "complete", unflagged_control)
    unflagged = _evaluate(pair, tokenizer, items[:2])
    assert right["acc_control"] == 0 and unflagged["acc_control"] == 1
    assert unflagged["map_minus_control"] == 0 and unflagged["median_agreement_control"] == AGREEMENT


def test_text_is_tokenised_only_when_the_server_sends_no_ids(tokenizer):
    assert Completion(None, "abc", {}).ids(tokenizer) == [97, 98, 99]
    assert Completion([1, 2], "abc", {}).ids(tokenizer) == [1, 2]
    # the connector's count, not recomputed + prefill (which counts the last prompt token too)
    report = {"recomputed_tokens": 4, "prefill_tokens": 36, "exact_tokens": 39}
    assert Completion([1], "", {"kvhub": report}).recomputed_tokens == 39
    assert Completion([1], "", {"kvhub": {"exact_tokens": True}}).recomputed_tokens is None
    assert Completion([1], "", {}).recomputed_tokens is None
    assert Completion([1], "", {"kvhub": {"deshrink": "off"}}).deshrink == "off"
    assert Completion([1], "", {"kvhub": {"deshrink": 1}}).deshrink is None
    assert served.reported_deshrink(["kv", None, "kv"]) == "kv"
    assert served.reported_deshrink(["kv", "off"]) == "mixed" and served.reported_deshrink([None]) is None


# ---- errors ------------------------------------------------------------------------------------------
def test_an_http_error_names_the_url_and_the_status(pair):
    with pytest.raises(ServeError) as caught:
        Endpoint(pair.large_url, LARGE_NAME).complete([VOCAB + 5], max_tokens=1, cache_salt="t")
    message = str(caught.value)
    assert f"{pair.large_url}/completions answered HTTP 400: prompt must be a non-empty list" in message
    assert "\n" not in message
    with pytest.raises(ServeError, match="HTTP 404: The model `nope` does not exist"):
        Endpoint(pair.large_url, "nope").complete([65], max_tokens=1, cache_salt="t")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _invoke(*args):
    return CliRunner().invoke(main, ["eval-serve", *map(str, args)])


def test_a_server_that_is_not_running_is_one_line_naming_kvhub_serve():
    url = f"http://127.0.0.1:{_free_port()}/v1"
    result = _invoke("--small", url, "--large", url, "--task", "facts")
    assert result.exit_code == ServeError.exit_code, result.output
    assert f"nothing answers at {url}/models: the server is not running" in result.output
    assert "`kvhub serve`" in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_bad_options_are_refused_before_any_request():
    result = _invoke("--small", "http://127.0.0.1:8001", "--large", "http://127.0.0.1:8002/v1", "--task", "facts")
    assert result.exit_code == 2 and "--small 'http://127.0.0.1:8001' is not an OpenAI base URL" in result.output
    result = _invoke("--small", "file:///etc/v1", "--large", "http://127.0.0.1:8002/v1", "--task", "facts")
    assert result.exit_code == 2 and "is not an OpenAI base URL" in result.output
    result = _invoke("--small", "http://a/v1", "--large", "http://b/v1", "--task", "code", "--log-samples")
    assert result.exit_code == 2 and "add --output-path" in result.output


# ---- the command -------------------------------------------------------------------------------------
def test_json_document_and_samples(pair, tmp_path):
    out = tmp_path / "results.json"
    result = _invoke(
        "--small",
        pair.small_url,
        "--large",
        pair.large_url,
        "--task",
        "code",
        "--context-tokens",
        64,
        "--limit",
        1,
        "--agreement-tokens",
        4,
        "--json",
        "--output-path",
        out,
        "--log-samples",
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert json.loads(out.read_text()) == doc
    summary = doc["results"]["code-64"]
    for key in (
        "acc_own",
        "acc_mapped",
        "acc_control",
        "acc_source",
        "acc_floor",
        "retention_ci",
        "map_minus_control_ci",
        "median_agreement_mapped",
        "median_agreement_control",
        "recomputed_fraction",
    ):
        assert key in summary, key
    assert summary["n"] == 1 and summary["acc_own"] == summary["acc_mapped"] and summary["transfers_reported"] == 1
    assert summary["median_agreement_mapped"] == summary["agreement_tokens"] == 4  # the stand-in's map is exact
    config = doc["config"]
    assert config["small"] == {"url": pair.small_url, "model": pair.small_name}  # names from GET /models
    assert config["large"] == {"url": pair.large_url, "model": LARGE_NAME}
    assert config["tokenizer"] == pair.small_name and config["datasets"]["code-64"]["n"] == 1
    samples = [json.loads(line) for line in next(tmp_path.glob("samples_code-64_*.jsonl")).read_text().splitlines()]
    assert len(samples) == 1 and all(set(s["prediction"]) == set(SERVED_CONDITIONS) for s in samples)


def test_table_and_a_server_error_through_the_command(pair):
    args = (
        "--small",
        pair.small_url,
        "--large",
        pair.large_url,
        "--task",
        "code",
        "--context-tokens",
        64,
        "--limit",
        1,
        "--agreement-tokens",
        4,
    )
    result = _invoke(*args)
    assert result.exit_code == 0, result.output
    header, row = result.stdout.splitlines()[1:3]
    assert header.split()[:4] == ["task", "n", "tokens", "recomputed"] and "map - control [95% CI]" in header
    assert row.split()[:2] == ["code-64", "1"] and row.split()[-5:-3] == ["4", "/"] and row.endswith(" of 4")
    result = _invoke(*args, "--large-model", "nope")
    assert result.exit_code == ServeError.exit_code and "Traceback" not in result.output
    assert f"{pair.large_url}/completions answered HTTP 404: The model `nope` does not exist." in result.output


def test_a_failing_task_keeps_what_was_scored(pair, tmp_path, monkeypatch):
    """A server error in a later task (a prompt over the large server's context length) stops the run, but the
    tasks finished before it are printed and written, the document saying where it stopped, and the exit code
    is still the error's.

    Planted bugs caught: finished tasks thrown away on a later failure (ux-4 U4-9: 9 s of facts results gone,
    no table, no JSON); a partial run exiting 0 (a script taking it for complete); the document not saying
    it is partial; the failing task's name or the server's message lost."""
    limit = 120  # code-64's prompts fit, code-256's do not
    contract = _contract_problem

    def too_long(body):
        if isinstance(body.get("prompt"), list) and len(body["prompt"]) > limit:
            return f"This model's maximum context length is {limit} tokens"
        return contract(body)

    monkeypatch.setitem(globals(), "_contract_problem", too_long)
    out = tmp_path / "results.json"
    args = ("--small", pair.small_url, "--large", pair.large_url, "--task", "code", "--limit", 1)
    result = _invoke(*args, "--context-tokens", 64, "--context-tokens", 256, "--output-path", out)
    assert result.exit_code == ServeError.exit_code, result.output
    assert "code-64" in result.stdout and "code-256" not in result.stdout
    assert "stopped at code-256" in result.stderr and f"maximum context length is {limit} tokens" in result.stderr
    doc = json.loads(out.read_text())
    assert set(doc["results"]) == {"code-64"} and doc["config"]["stopped"]["task"] == "code-256"
    assert "maximum context length" in doc["config"]["stopped"]["error"]


def test_prompts_longer_than_the_servers_take_are_refused_before_any_request(pair, monkeypatch):
    """Every task's items are built and checked against the `max_model_len` GET /v1/models reports before the
    first completion: a length whose prompts (with their answers) do not fit is refused by name, with the
    length that would fit, and no request is sent.

    Planted bugs caught: the check skipped for served runs (ux-4 U4-9: HTTP 400 after 9 s of facts, from the
    server); only the first task checked before requests start; the answer tokens left out of the length."""
    monkeypatch.setattr(pair, "max_model_len", 120)
    args = ("--small", pair.small_url, "--large", pair.large_url, "--task", "code", "--limit", 1)
    result = _invoke(*args, "--context-tokens", 64, "--context-tokens", 256)
    assert result.exit_code == ConfigError.exit_code, result.output
    assert "--context-tokens 256 builds prompts of up to" in result.stderr
    assert "max_model_len 120" in result.stderr and pair.requests == []
    assert _invoke(*args, "--context-tokens", 64).exit_code == 0
