"""``kvhub serve`` end to end with the real vLLM engine (CPU build), on the tiny exact family of
tests/serving/test_vllm_connector.py given a character-level tokenizer and a chat template, so the two servers
answer OpenAI chat completions.  A cascade's escalation:

1. a conversation goes to the small server as tenant "alice" (cache_salt): its prompt KV is stored;
2. the same messages, same cache_salt, go to the large server: the stored prefix is mapped into its
   blocks, the large model recomputes the first 4 and ~8% of the prompt over them (its worker class hands
   the model to the connector), and (the family is exact) its greedy output is the large model's own;
3. the same messages as tenant "other": no stored KV there, so the large model prefills: its own output;
4. four conversations escalated at once, two selected by the small model's stored attention (select=source):
   each answer is the large model's own.

Both engines run in vLLM's compiled mode (no --enforce-eager); tests/serving/test_vllm_connector.py runs eager.

Run with scripts/test-vllm.sh (needs .venv-vllm from scripts/setup-vllm.sh); about 3-5 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.serving.test_vllm_connector import _engine_available, make_family

ROOT = Path(__file__).resolve().parents[2]
BLOCK, EXACT_TAIL, NEW_TOKENS, BUDGET = 32, 16, 12, 0.6
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "You answer questions about the kvhub test suite, briefly."},
    {"role": "user", "content": "Which server computes the prompt first, and which one maps it?"},
]
needs_vllm = pytest.mark.skipif(not _engine_available(), reason="vLLM is not installed (scripts/setup-vllm.sh)")


def save_char_tokenizer(directory: str) -> None:
    """One token per ASCII character (id = code point, 0 = unknown), with CHAT_TEMPLATE: within the tiny
    models' 128-token vocabulary, shared by source and target as in a real family."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{chr(i): i for i in range(1, 128)}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", chat_template=CHAT_TEMPLATE).save_pretrained(
        directory
    )


def _free_ports() -> list[int]:
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        return [a.getsockname()[1], b.getsockname()[1]]


def _chat(url: str, model: str, salt: str, messages: list[dict] | None = None, params: dict | None = None) -> dict:
    body = {
        "model": model,
        "messages": messages or MESSAGES,
        "cache_salt": salt,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **({"kv_transfer_params": params} if params else {}),
    }
    request = urllib.request.Request(
        f"{url}/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=300) as response:
        return json.load(response)


def _group_members(pgids: set[int]) -> list[int]:
    """Live processes in these process groups (a server and the engine process it started)."""
    members = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, ValueError):
            continue
        if entry.name.isdigit() and fields[0] not in ("Z", "X") and int(fields[2]) in pgids:
            members.append(int(entry.name))
    return members


@pytest.mark.vllm
@needs_vllm
def test_the_contract_names_the_class_vllm_loads():
    import importlib

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvhub.serving import launch

    connector = getattr(importlib.import_module(launch.CONNECTOR_MODULE), launch.CONNECTOR_CLASS)
    assert issubclass(connector, KVConnectorBase_V1)


def _concurrent_escalations(ready: dict, paths: dict) -> None:
    """Four conversations escalated at once (four requests in flight on the large server, two selecting by the
    small model's stored attention, two by the large model's): each answer is the large model's own."""
    from concurrent.futures import ThreadPoolExecutor

    conversations = [
        [MESSAGES[0], {"role": "user", "content": f"Question {i}: which tenant stored conversation {i}, and why?"}]
        for i in range(4)
    ]
    for messages in conversations:
        _chat(ready["small"]["url"], "tiny/src", "bob", messages)  # stored under tenant bob
    own = [_chat(ready["large"]["url"], "tiny/dst", "carol", messages) for messages in conversations]
    selectors = ["source", "target", "source", "target"]
    with ThreadPoolExecutor(4) as pool:
        escalated = list(
            pool.map(
                lambda args: _chat(
                    ready["large"]["url"], "tiny/dst", "bob", args[0], {"kvhub_recompute": f"select={args[1]}"}
                ),
                zip(conversations, selectors),
            )
        )
    for mine, theirs, select in zip(escalated, own, selectors):
        report = mine["kv_transfer_params"]["kvhub"]
        assert report["mapped_tokens"] > 0 and "fallback" not in report and "select_fallback" not in report, report
        assert f"select={select}" in report["recompute"], report
        assert mine["choices"][0]["token_ids"] == theirs["choices"][0]["token_ids"], (select, report)


@pytest.mark.vllm
@needs_vllm
def test_serve_escalates_a_conversation_to_the_large_server(tmp_path):
    paths = make_family(tmp_path)
    for model in ("source", "target"):
        save_char_tokenizer(paths[model])
    ports = _free_ports()
    command = [
        sys.executable,
        "-m",
        "kvhub",
        "serve",
        "src:dst:tiny-calib@latest",
        "--db",
        paths["db"],
        "--kvstore-dir",
        paths["kvstore"],
        "--small-model",
        paths["source"],
        "--large-model",
        paths["target"],
        "--vllm",
        str(Path(sys.executable).parent / "vllm"),
        "--events",
        paths["events"],
        "--port-small",
        str(ports[0]),
        "--port-large",
        str(ports[1]),
        "--log-dir",
        str(tmp_path / "logs"),
        "--json",
        "--timeout",
        "600",
        "--exact-budget",
        str(BUDGET),  # room for a whole sentence of chars
        "--min-escalation-tokens",
        "0",  # a conversation under the default 256 tokens: escalated all the same
        "--",
        "--dtype",
        "float32",
        "--block-size",
        str(BLOCK),
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "4",  # no --enforce-eager: both engines run vLLM's compiled mode, the recompute pass beside it
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)}
    stderr_path = tmp_path / "serve.stderr"
    shm_before = set(Path("/dev/shm").glob("psm_*"))  # multiprocessing's shared memory: vLLM's engine queues
    with open(stderr_path, "w") as stderr:
        serve = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
    pgids: set[int] = set()
    try:
        line = serve.stdout.readline()
        assert line, f"kvhub serve exited {serve.wait()} before both servers were ready:\n{stderr_path.read_text()}"
        ready = json.loads(line)
        pgids = {ready["small"]["pid"], ready["large"]["pid"]}  # each server leads its own process group
        small = _chat(ready["small"]["url"], "tiny/src", "alice")
        mapped = _chat(ready["large"]["url"], "tiny/dst", "alice")  # the escalation
        own = _chat(ready["large"]["url"], "tiny/dst", "other")  # no stored KV for this tenant: prefill

        prompt = small["prompt_token_ids"]
        assert mapped["prompt_token_ids"] == own["prompt_token_ids"] == prompt  # one tokenizer, one template
        events = [json.loads(e) for e in Path(paths["events"]).read_text().splitlines()]
        assert [e["tokens"] for e in events if e["event"] == "saved"] == [len(prompt)]
        consumer = [e for e in events if e["role"] == "consumer"]
        hit, fallback = [e for e in consumer if e["event"] in ("hit", "fallback")]
        end = (len(prompt) - EXACT_TAIL) // BLOCK * BLOCK
        assert (hit["event"], hit["start"], hit["end"]) == ("hit", 0, end) and end >= BLOCK
        assert end <= hit["stored_tokens"] <= len(prompt) - EXACT_TAIL  # the stored prompt's longest usable prefix
        assert fallback["event"] == "fallback" and fallback["reason"] == "no stored source KV for this prompt"
        assert [e["tokens"] for e in consumer if e["event"] == "mapped"] == [end]
        assert [e["layers"] for e in consumer if e["event"] == "written"] == [4]  # every target layer
        # the large model recomputed the first 4 and whole sentences/lines chosen by its attention (the char
        # tokenizer reaches the connector), and says so in the response
        report = mapped["kv_transfer_params"]["kvhub"]
        recomputed = [e for e in consumer if e["event"] == "recomputed"]
        assert len(recomputed) == 1 and recomputed[0]["recomputed_tokens"] == report["recomputed_tokens"]
        assert report["exact_prefix_tokens"] == 4 and report["mapped_tokens"] == end
        rounding = len(prompt) - end - EXACT_TAIL  # the tail beyond the suffix comes out of the budget
        assert 0 < report["selected_tokens"] <= round(BUDGET * (len(prompt) - 1)) - rounding
        assert report["prefill_tokens"] == len(prompt) - end
        assert len(own["choices"][0]["token_ids"]) == NEW_TOKENS
        assert mapped["choices"][0]["token_ids"] == own["choices"][0]["token_ids"], (
            "greedy output from the mapped + recomputed cache differs from the large model's own"
        )

        _concurrent_escalations(ready, paths)

        serve.send_signal(signal.SIGINT)
        assert serve.wait(timeout=120) == 0, stderr_path.read_text()
        assert "both servers stopped" in stderr_path.read_text()
        assert _group_members(pgids) == [], "a server or its engine outlived kvhub serve"
        left = sorted(p.name for p in set(Path("/dev/shm").glob("psm_*")) - shm_before)
        assert not left, f"Ctrl-C left vLLM's shared memory in /dev/shm: {left}"  # ux-4 U4-6
    finally:
        if serve.poll() is None:
            serve.terminate()
            try:
                serve.wait(timeout=60)
            except subprocess.TimeoutExpired:
                serve.kill()
                serve.wait()
        for pgid in pgids:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
