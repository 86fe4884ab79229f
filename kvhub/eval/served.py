"""Scoring a running ``kvhub serve`` pair over HTTP on the long-context tasks of :mod:`kvhub.eval.longctx`.

Every item is five greedy completions (``POST {url}/completions`` with a token-id prompt, ``temperature``
0, ``ignore_eos``, ``return_token_ids``), sent one at a time in this order so the engines never race and
the small server has stored the prompt's KV before the large one looks for it:

=========  ======  ========================================  ============================================
condition  server  cache_salt                                what happens
=========  ======  ========================================  ============================================
source     small   the item's tenant                         the small model answers; its KV is stored
own        large   a fresh one (nothing stored under it)     the large model's own prefill
mapped     large   the item's tenant                         the stored KV is mapped (the escalation)
control    large   the item's tenant, with                   mapped with the no-information control map
                   ``kv_transfer_params.kvhub_control``
floor      large   a fresh one                               own prefill of the last FLOOR_TOKENS tokens
=========  ======  ========================================  ============================================

Scores keep :class:`~kvhub.eval.longctx.RecallScore`'s shape: ``exact[c]`` is 1 iff the first len(answer)
generated ids are the answer's, ``token_acc[c]`` the fraction of those positions that match, and
``logp[c]`` is 0.0 for every condition: served scores carry no log-likelihood.  ``recomputed`` is
``kv_transfer_params["kvhub"]["exact_tokens"]`` of the mapped response (0 when the large server
reports none).  own, mapped and control generate max(len(answer), agreement_tokens) tokens;
``agree_mapped`` / ``agree_control`` count the leading ones, of the first agreement_tokens, equal to own's.

HTTP goes through the standard library and never through a proxy; every failure is a one-line
:class:`~kvhub.errors.ServeError` naming the URL (without its user and password, and with a server's control
characters shown escaped).  ``timeout`` is each request's whole deadline, not each read's, and an answer
longer than :data:`MAX_BODY_BYTES` is refused.  An answer that cannot be a vLLM completion (ids that are not
token ids, an ``exact_tokens`` outside the prompt, log-probabilities above 0 or not finite) is refused, not
scored.
"""

from __future__ import annotations

import http.client
import json
import math
import statistics
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvhub.errors import ConfigError, ServeError

if TYPE_CHECKING:
    from kvhub.eval.longctx import RecallItem, RecallScore


AGREEMENT_TOKENS = 32
TIMEOUT_S = 600.0
TENANT_PREFIX = "kvhub-eval-"
CONTROL_PARAMS = {"kvhub_control": True}  # kv_transfer_params asking the connector for the control map
_DETAIL_CHARS = 300
MAX_BODY_BYTES = 64 << 20  # a completion with logprobs is kilobytes; /models a few
MAX_TOKEN_ID = 2**31 - 1  # tokenizers hold ids in 32 bits; anything above is not a token id
_READ_BYTES = 1 << 16
# $http_proxy is for the internet; the pair runs on this machine or its cluster, where a proxy only gets in the way
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))

# The conditions a served run scores: no `drop`, which needs the large engine to prefill chosen positions
# at their true positions (kvhub eval scores it in the library).
SERVED_CONDITIONS = ("own", "mapped", "control", "source", "floor")


# ---- talking to one server ---------------------------------------------------------------------------
def base_url(url: str, *, option: str = "URL") -> str:
    """``url`` without a trailing slash, refused (ConfigError) unless it is an http(s) base URL ending in /v1."""
    trimmed = url.strip().rstrip("/")
    parts = urllib.parse.urlsplit(trimmed)
    if parts.scheme not in ("http", "https") or not parts.netloc or not parts.path.endswith("/v1"):
        raise ConfigError(
            f"{option} {redacted(url)!r} is not an OpenAI base URL like http://127.0.0.1:8001/v1; "
            "`kvhub serve --json` prints both servers' URLs"
        )
    if "@" in parts.netloc:
        raise ConfigError(
            f"{option} {redacted(url)!r} names a user (and password) in the URL, which kvhub eval-serve "
            "never sends; give the server's URL without them"
        )
    return trimmed


def redacted(url: str) -> str:
    """``url`` with its user and password (``user:pw@``) replaced by ``***@``, for messages."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, path = rest.partition("/")
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    return f"{scheme}{sep}{netloc}{slash}{path}"


def served_models(url: str, *, timeout: float = TIMEOUT_S) -> list[str]:
    """The model ids ``GET {url}/models`` lists (at least one, else ServeError)."""
    return list(_model_lengths(url, timeout=timeout))


def _model_lengths(url: str, *, timeout: float) -> dict[str, int | None]:
    """Model id -> the ``max_model_len`` ``GET {url}/models`` reports for it (vLLM does; None where not)."""
    answer = _request(f"{url}/models", timeout=timeout)
    data = answer.get("data") if isinstance(answer, dict) else None
    entries = [entry for entry in data or [] if isinstance(entry, dict) and isinstance(entry.get("id"), str)]
    if not entries:
        raise ServeError(f"{url}/models lists no model; is {url} an OpenAI-compatible server (`kvhub serve`)?")
    lengths = {}
    for entry in entries:
        length = entry.get("max_model_len")
        lengths[entry["id"]] = (
            length if isinstance(length, int) and not isinstance(length, bool) and length > 0 else None
        )
    return lengths


@dataclass(frozen=True)
class Completion:
    """One completion: the generated ids (None when the server did not return them), their text, and the
    response's ``kv_transfer_params`` (what the KV connector reports; {} when absent)."""

    token_ids: list[int] | None
    text: str
    kv_transfer_params: dict
    logprobs: list[float] | None = None  # of each generated token, when asked for (raw: before any processor)

    def ids(self, tokenizer) -> list[int]:
        """The generated ids; re-tokenised from the text only when the server sent none."""
        if self.token_ids is not None:
            return self.token_ids
        return tokenizer(self.text, add_special_tokens=False)["input_ids"]

    @property
    def recomputed_tokens(self) -> int | None:
        """Context positions the large model computed exactly after a load, as the connector counted them
        (``exact_tokens``: the recomputed ones and the tail vLLM prefills, its last prompt token excepted, as
        ``kvhub eval`` counts prepare_cache_counted's positions); None when the connector reported no transfer."""
        transfer = self.kv_transfer_params.get("kvhub")
        count = transfer.get("exact_tokens") if isinstance(transfer, dict) else None
        return count if isinstance(count, int) and not isinstance(count, bool) else None

    @property
    def deshrink(self) -> str | None:
        """How the large server read the maps for this request (:mod:`kvhub.core.deshrink`), as the connector
        reported it; None when it reported no transfer (or a connector too old to say)."""
        transfer = self.kv_transfer_params.get("kvhub")
        value = transfer.get("deshrink") if isinstance(transfer, dict) else None
        return value if isinstance(value, str) else None


def reported_deshrink(values) -> str | None:
    """The ``deshrink`` the mapped requests of a run reported: one value, "mixed" for several, None for none."""
    found = {value for value in values if value is not None}
    return found.pop() if len(found) == 1 else ("mixed" if found else None)


@dataclass(frozen=True)
class Endpoint:
    """One OpenAI-compatible server: ``url`` its base URL (``http://HOST:PORT/v1``), ``model`` the name it
    serves, ``timeout`` seconds allowed per request."""

    url: str
    model: str
    timeout: float = TIMEOUT_S
    max_model_len: int | None = None  # prompt + generated tokens the server takes, as its /models reports

    @classmethod
    def at(cls, url: str, *, model: str | None = None, timeout: float = TIMEOUT_S, option: str = "URL") -> Endpoint:
        """The server at ``url`` (checked by :func:`base_url`); ``model`` defaults to the first id it lists."""
        url = base_url(url, option=option)
        lengths = _model_lengths(url, timeout=timeout)
        model = model or next(iter(lengths))
        return cls(url, model, timeout, lengths.get(model))

    def complete(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        cache_salt: str,
        kv_transfer_params: dict | None = None,
        logprobs: bool = False,
        vllm_xargs: dict | None = None,
    ) -> Completion:
        """Greedy ``max_tokens`` tokens after ``prompt_ids`` (EOS ignored), in the namespace ``cache_salt``;
        ``logprobs``: with the log-probability of each generated token; ``vllm_xargs``: vLLM's extension
        parameters (kvhub.serving.forced reads one)."""
        body = {
            "model": self.model,
            "prompt": [int(i) for i in prompt_ids],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "cache_salt": cache_salt,
        }
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        if logprobs:
            body["logprobs"] = 1
        if vllm_xargs is not None:
            body["vllm_xargs"] = vllm_xargs
        url = f"{self.url}/completions"
        answer = _request(url, body, timeout=self.timeout)
        try:
            choice = answer["choices"][0]
            token_ids, text = choice.get("token_ids"), choice.get("text") or ""
        except (KeyError, IndexError, TypeError, AttributeError) as exc:
            raise ServeError(f"{url} answered without choices[0]: {_detail(json.dumps(answer).encode())}") from exc
        params = answer.get("kv_transfer_params")
        params = params if isinstance(params, dict) else {}
        _check_report(url, params, prompt_tokens=len(body["prompt"]))
        if not isinstance(text, str):
            raise ServeError(
                f"{url} answered a choices[0].text that is not a string: {_detail(json.dumps(text).encode())}"
            )
        return Completion(_token_ids(url, token_ids), text, params, _token_logprobs(url, choice) if logprobs else None)


def _token_ids(url: str, value) -> list[int] | None:
    """choices[0].token_ids as a list of token ids (None when absent); ServeError for anything else (text,
    floats, booleans, negative or out-of-range numbers): nothing is truncated or guessed."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= MAX_TOKEN_ID for i in value
    ):
        raise ServeError(
            f"{url} answered choices[0].token_ids that are not token ids (a list of integers from 0 to "
            f"{MAX_TOKEN_ID}): {_detail(_dumps(value))}; is it a vLLM server (`kvhub serve`)?"
        )
    return value


def _check_report(url: str, params: dict, *, prompt_tokens: int) -> None:
    """ServeError for a connector report (kv_transfer_params.kvhub) no kvhub connector sends: ``exact_tokens`` or
    ``mapped_tokens`` not a whole number in 0..``prompt_tokens``, a ``select_fallback`` not a non-empty reason."""
    report = params.get("kvhub") if isinstance(params.get("kvhub"), dict) else {}
    counts = {n: v for n, v in report.items() if n in ("exact_tokens", "mapped_tokens")}
    bad = [f"{n}={_detail(_dumps(v))}" for n, v in counts.items() if type(v) is not int or not 0 <= v <= prompt_tokens]
    reason = report.get("select_fallback")
    if reason is not None and not (isinstance(reason, str) and reason.strip()):
        bad.append(f"select_fallback={_detail(_dumps(reason))} (not the reason it fell back: a non-empty text)")
    if bad:
        raise ServeError(
            f"{url} reported kv_transfer_params.kvhub.{bad[0]} for a prompt of {prompt_tokens} tokens (counts are "
            "whole numbers from 0 to its length); the large server's connector is not kvhub's, or is broken"
        )


def _token_logprobs(url: str, choice: dict) -> list[float]:
    """choices[0].logprobs.token_logprobs as floats; ServeError when the server sent none, or values that are
    not log-probabilities (above 0, or not finite: +3.0 would score as a negative NLL, -inf as a null one)."""
    values = (choice.get("logprobs") or {}).get("token_logprobs") if isinstance(choice, dict) else None
    if not isinstance(values, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise ServeError(
            f"{url} answered without choices[0].logprobs.token_logprobs (asked with logprobs=1): "
            f"{_detail(_dumps(choice))}"
        )
    bad = [v for v in values if not (math.isfinite(v) and v <= 0.0)]
    if bad:
        raise ServeError(
            f"{url} answered token_logprobs that are not log-probabilities (finite and at most 0): "
            f"{_detail(_dumps(bad[:5]))}; the scores would be meaningless"
        )
    return [float(v) for v in values]


def _dumps(value) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


def _request(url: str, body: dict | None = None, *, timeout: float):
    """The JSON answer to GET ``url`` (``body`` None) or to POST ``body`` within ``timeout`` seconds in all;
    any failure is a one-line ServeError."""
    if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
        raise ConfigError(f"the request timeout must be a finite number of seconds above 0, got {timeout!r}")
    deadline = time.monotonic() + timeout
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            raw = _read_body(url, response, deadline=deadline)
    except urllib.error.HTTPError as exc:
        raise ServeError(f"{url} answered HTTP {exc.code}: {_detail(_read_error(exc))}") from exc
    except urllib.error.URLError as exc:
        raise _unreachable(url, exc.reason, timeout) from exc
    except (OSError, http.client.HTTPException) as exc:  # a timeout or a connection dropped mid-answer
        raise _unreachable(url, exc, timeout) from exc
    try:
        return json.loads(raw)
    except RecursionError:
        raise ServeError(f"{url} answered JSON nested too deeply to read: {_detail(raw)}") from None
    except ValueError as exc:
        raise ServeError(f"{url} answered something that is not JSON: {_detail(raw)}") from exc


def _read_body(url: str, response, *, deadline: float) -> bytes:
    """The body, read in pieces until ``deadline`` (TimeoutError past it, however slowly the server sends) and
    at most :data:`MAX_BODY_BYTES` (ServeError past that: a server streaming forever)."""
    sock = getattr(getattr(getattr(response, "fp", None), "raw", None), "_sock", None)
    pieces, size = [], 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        if sock is not None:
            sock.settimeout(left)  # one read never outlasts the request's deadline
        piece = response.read1(_READ_BYTES)
        if not piece:
            return b"".join(pieces)
        size += len(piece)
        if size > MAX_BODY_BYTES:
            raise ServeError(
                f"{url} answered more than {MAX_BODY_BYTES >> 20} MiB, far more than a completion; "
                "is it an OpenAI-compatible server (`kvhub serve`)?"
            )
        pieces.append(piece)


def _read_error(error: urllib.error.HTTPError) -> bytes:
    try:
        return error.read(64 * _DETAIL_CHARS)  # only its start is shown
    except OSError:
        return b""


def _detail(raw: bytes) -> str:
    """The start of an answer's body on one line, control characters shown escaped (``\\x1b``: a server's
    bytes never drive the terminal): an OpenAI error's message when there is one."""
    text = raw[: 64 * _DETAIL_CHARS].decode("utf-8", errors="replace")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        data = None
    if isinstance(data, dict):
        error = data.get("error")
        message = error.get("message") if isinstance(error, dict) else data.get("message")
        text = message if isinstance(message, str) else text
    text = " ".join(text.split()) or "(empty body)"
    text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
    return text if len(text) <= _DETAIL_CHARS else text[:_DETAIL_CHARS] + "..."


def _unreachable(url: str, reason, timeout: float) -> ServeError:
    if isinstance(reason, ConnectionRefusedError):
        return ServeError(
            f"nothing answers at {url}: the server is not running; start the pair with "
            "`kvhub serve` (its --json line prints both URLs)"
        )
    url = redacted(url)
    if isinstance(reason, TimeoutError):
        return ServeError(
            f"{url} did not answer within {timeout:g} s; is the server busy or stuck? A longer --timeout waits more"
        )
    return ServeError(
        f"cannot reach {url}: {' '.join(str(reason).split())}; check the URL and that `kvhub serve` is running there"
    )


# ---- scoring -----------------------------------------------------------------------------------------
@dataclass
class ServedScore:
    """One item scored on the servers: ``recall`` in longctx's shape (logp 0.0: no log-likelihood over HTTP);
    ``agree_mapped`` / ``agree_control``: leading generated tokens equal to own's, of agreement_tokens;
    ``transfer_reported``: the large server reported a kvhub transfer for the mapped request;
    ``deshrink``: how it read the maps (:attr:`Completion.deshrink`)."""

    recall: RecallScore
    agree_mapped: int
    agree_control: int
    transfer_reported: bool
    deshrink: str | None = None


def new_tenant() -> str:
    """A cache_salt no request used before: a namespace of its own in both servers and the KV store."""
    return f"{TENANT_PREFIX}{uuid.uuid4().hex}"


def token_accuracy(generated: list[int], answer: list[int]) -> float:
    """Fraction of the answer's positions where ``generated`` has the answer's token."""
    return sum(g == a for g, a in zip(generated, answer)) / max(1, len(answer))


def leading_agreement(generated: list[int], reference: list[int]) -> int:
    """How many leading tokens of ``generated`` equal ``reference``'s."""
    count = 0
    for g, r in zip(generated, reference):
        if g != r:
            break
        count += 1
    return count


def score_served_item(
    item: RecallItem, *, small: Endpoint, large: Endpoint, tokenizer, agreement_tokens: int = AGREEMENT_TOKENS
) -> ServedScore:
    """``item`` under the five conditions (module docstring), one request at a time."""
    from kvhub.eval.longctx import FLOOR_TOKENS, RecallScore

    prompt, answer = item.prompt_ids, item.answer_ids
    longer = max(len(answer), agreement_tokens)
    tenant = new_tenant()
    completions = {}  # in this order: source stores the KV that mapped and control then load
    completions["source"] = small.complete(prompt, max_tokens=len(answer), cache_salt=tenant)
    completions["own"] = large.complete(prompt, max_tokens=longer, cache_salt=new_tenant())
    completions["mapped"] = large.complete(prompt, max_tokens=longer, cache_salt=tenant)
    completions["control"] = large.complete(
        prompt, max_tokens=longer, cache_salt=tenant, kv_transfer_params=dict(CONTROL_PARAMS)
    )
    completions["floor"] = large.complete(prompt[-FLOOR_TOKENS:], max_tokens=len(answer), cache_salt=new_tenant())
    ids = {c: completion.ids(tokenizer) for c, completion in completions.items()}
    conditions = SERVED_CONDITIONS
    head = {c: ids[c][: len(answer)] for c in conditions}
    recomputed = completions["mapped"].recomputed_tokens
    recall = RecallScore(
        id=item.id,
        exact={c: int(head[c] == answer) for c in conditions},
        token_acc={c: token_accuracy(head[c], answer) for c in conditions},
        logp={c: 0.0 for c in conditions},
        recomputed=recomputed or 0,
        meta=item.meta,
        predicted={c: tokenizer.decode(head[c]) for c in conditions},
        gold=item.answer,
    )
    own = ids["own"][:agreement_tokens]
    return ServedScore(
        recall,
        agree_mapped=leading_agreement(ids["mapped"][:agreement_tokens], own),
        agree_control=leading_agreement(ids["control"][:agreement_tokens], own),
        transfer_reported=recomputed is not None,
        deshrink=completions["mapped"].deshrink,
    )


def summarize_served(scores: list[ServedScore], *, seed: int = 0) -> dict:
    """:func:`~kvhub.eval.longctx.summarize_recall` of the scores, plus the median agreement of mapped and
    control with own (NaN without items), how many mapped requests reported a transfer and how the large
    server read the maps (:func:`reported_deshrink`)."""
    from kvhub.eval.longctx import summarize_recall

    summary = summarize_recall([score.recall for score in scores], seed=seed)
    for condition in ("mapped", "control"):
        values = [getattr(score, f"agree_{condition}") for score in scores]
        summary[f"median_agreement_{condition}"] = statistics.median(values) if values else math.nan
    summary["transfers_reported"] = sum(score.transfer_reported for score in scores)
    summary["deshrink"] = reported_deshrink(score.deshrink for score in scores)
    return summary


def served_record(task: str, item: RecallItem, score: ServedScore) -> dict:
    """``--log-samples``' record of one item: :func:`kvhub.eval.results.recall_record` plus the agreement."""
    from kvhub.eval.results import recall_record

    return {
        **recall_record(task, "served", item, score.recall),
        "agreement": {"mapped": score.agree_mapped, "control": score.agree_control},
        "transfer_reported": score.transfer_reported,
    }
