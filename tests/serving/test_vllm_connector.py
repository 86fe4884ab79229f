"""End to end with the real vLLM engine (CPU build): producer on a tiny source model, consumer on its exact
target (tests/tinymodels.py: the target computes exactly the source's function, so a correct map gives the
target's own greedy output).

Run with scripts/test-vllm.sh (needs .venv-vllm from scripts/setup-vllm.sh).  vLLM spawns its engine
process, so each engine runs in a subprocess of this file (``python tests/serving/test_vllm_connector.py ROLE``),
one for the producer and one for the consumer; the consumer's requests, in order:

1. prompt A as tenant "other" (cache_salt): no stored KV in that namespace -> fallback; this is the big
   model's own output for A (and shows another tenant gets no hit);
2. prompt A as tenant "alice": the producer's KV, mapped and the default recompute run by the large
   model -> must equal 1.;
3. prompt A as "alice" again: vLLM's own prefix cache must not hit the mapped blocks (local hit 0);
4. prompt B as "alice": never produced -> fallback;
5. prompt C as "other", then as "alice" (map only) after the test stored random KV for it: the engine
   really reads what was mapped (its output must differ from C's own);
6. prompt A over the no-information control map: every mapped token recomputed -> own (the masked
   pass is a prefill); mapped only -> not own;
7. A and D in one engine step with different selections; a NaN store entry falls back to prefill.

A second consumer run plants a failing recompute (falls back, visibly) and compares the engine pass
with kvhub.serving.recompute in transformers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32
PROMPT_A = [(7 * i + 3) % 120 + 1 for i in range(100)]
PROMPT_B = [(11 * i + 5) % 120 + 1 for i in range(90)]
PROMPT_C = [(13 * i + 2) % 120 + 1 for i in range(100)]
PROMPT_D = [(17 * i + 9) % 120 + 1 for i in range(90)]
PROMPT_E = [(19 * i + 4) % 120 + 1 for i in range(100)]
PROMPT_C_LONGER = PROMPT_C + [(23 * i + 6) % 120 + 1 for i in range(30)]  # a later turn of C's conversation
MAP_ONLY_PARAMS = {"kvhub_recompute": "exact_prefix=0,exact_budget=0"}
NEW_TOKENS = 12


def _engine_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: no usable vLLM here
        return False
    return True


def make_family(directory: Path) -> dict:
    """Save the tiny exact pair as HF checkpoints, fit the mapper, register it in a store; returns paths."""
    import torch

    from kvhub.fitting.fit import fit
    from kvhub.fitting.options import FitOptions
    from kvhub.store import open_store
    from tests.tinymodels import exact_family_target, make_model

    source = make_model(
        "llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3
    )  # head_dim 32; the target's is 64: both CPU-backend sizes
    target, _ = exact_family_target(source, insert_before=(1,), kv_repeat=2, double_head_dim=True)
    paths = {
        "source": directory / "src",
        "target": directory / "dst",
        "db": directory / "kvhub.db",
        "kvstore": directory / "kvstore",
        "events": directory / "events.jsonl",
    }
    for name in ("source", "target"):
        model = source if name == "source" else target
        model.config.eos_token_id = None
        model.save_pretrained(paths[name])
    ids = torch.randint(1, 121, (32, 48), generator=torch.Generator().manual_seed(0))
    heldout = torch.randint(1, 121, (8, 48), generator=torch.Generator().manual_seed(1))
    mapper = fit(
        source,
        target,
        ids,
        heldout,
        source_id="tiny/src",
        target_id="tiny/dst",
        calibration={"name": "tiny-calib", "version": "1", "content_hash": "0" * 64, "tokens": int(ids.numel())},
        options=FitOptions(ridge_lambda=1e-9, stride=1, batch_size=8),
    )
    mapper.save(directory / "artifact")
    with open_store(str(paths["db"])) as store:
        store.register(directory / "artifact")
    return {name: str(path) for name, path in paths.items()}


def _transfer_config(paths: dict, role: str) -> dict:
    from kvhub.serving.launch import transfer_configs

    # the engines run without a tokenizer (skip_tokenizer_init): selected spans are single tokens
    return transfer_configs(
        kvstore_dir=paths["kvstore"],
        source_model="tiny/src",
        mapper="src:dst:tiny-calib@latest",
        db=paths["db"],
        events_path=paths["events"],
        kvstore_max_bytes=64 << 20,
        spans="token",
        min_escalation_tokens=0,
    )[role]  # 90-100-token prompts: escalated all the same


def run_engine(role: str, paths: dict, requests: list[tuple[list[int], str]]) -> list[list[int]]:
    """Greedy outputs of ``requests`` (prompt ids, cache_salt), one at a time, on the role's model."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from kvhub.serving.launch import WORKER_CLASS

    # the producer prefills in 64-token chunks: its prompt KV is saved from blocks filled over two steps;
    # KVHUB_TEST_MAX_BATCHED chunks the consumer's prefill too (the tail after a load and recompute)
    batched = 64 if role == "producer" else os.environ.get("KVHUB_TEST_MAX_BATCHED")
    chunk = {"max_num_batched_tokens": int(batched)} if batched else {}
    worker = {"worker_cls": WORKER_CLASS}  # the consumer's recompute, the producer's source attention
    llm = LLM(
        model=paths["source" if role == "producer" else "target"],
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=BLOCK,
        max_model_len=256,
        max_num_seqs=4,
        enforce_eager=True,
        enable_prefix_caching=True,
        kv_transfer_config=KVTransferConfig(**_transfer_config(paths, role)),
        **chunk,
        **worker,
    )
    outputs = []
    for batch in requests:  # a batch: [(prompt ids, cache_salt, kv_transfer_params or None), ...], one generate call
        prompts = [TokensPrompt(prompt_token_ids=prompt, cache_salt=salt) for prompt, salt, _ in batch]
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=NEW_TOKENS,
                ignore_eos=True,
                detokenize=False,
                extra_args={"kv_transfer_params": extra} if extra else None,
            )
            for _, _, extra in batch
        ]
        results = llm.generate(prompts, params, use_tqdm=False)
        outputs.append(
            [{"ids": list(r.outputs[0].token_ids), "kvhub": (r.kv_transfer_params or {}).get("kvhub")} for r in results]
        )
    if os.environ.get("KVHUB_TEST_COMPARE_PASS"):
        outputs.append(llm.collective_rpc(compare_engine_pass, args=(paths["target"],)))
    return outputs


def _spawn(role: str, paths: dict, requests, timeout: int = 900, env: dict | None = None) -> list:
    out = Path(paths["events"]).with_name(f"{role}-outputs.json")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    done = subprocess.run(
        [sys.executable, __file__, role, json.dumps(paths), json.dumps(requests), str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise AssertionError(f"{role} engine failed (rc {done.returncode}):\n{done.stderr[-6000:]}")
    return json.loads(out.read_text())


def _events(paths: dict) -> list[dict]:
    return [json.loads(line) for line in Path(paths["events"]).read_text().splitlines()]


needs_vllm = pytest.mark.skipif(not _engine_available(), reason="vLLM is not installed (scripts/setup-vllm.sh)")
ALL_EXACT = "exact_prefix=0,exact_budget=1.0,select=random,spans=token"  # every mapped token recomputed
MAP_ONLY = "exact_prefix=0,exact_budget=0"


def _budget(fraction: float, prompt: int, end: int, suffix: int = 16) -> int:
    """Selected tokens of a load: the budget less the block rounding of the tail (kvhub.serving.engine_pass)."""
    return max(0, round(fraction * (prompt - 1)) - (prompt - end - suffix))


@pytest.mark.vllm
@needs_vllm
def test_consumer_maps_and_recomputes_producer_kv_in_vllm_blocks(tmp_path):
    """The default recompute (first 4 + 8% selected + the exact suffix) over the mapped blocks, by the large
    model itself: with an exact map the escalated output is the large model's own; over the no-information
    control map, recomputing every mapped token is a prefill (own again) while mapping only is not."""
    paths = make_family(tmp_path)
    produced = _spawn("producer", paths, [[(PROMPT_A, "alice", None)], [(PROMPT_D, "alice", None)]])
    assert len(produced[0][0]["ids"]) == NEW_TOKENS
    saved = [e for e in _events(paths) if e["event"] == "saved"]
    assert [e["tokens"] for e in saved] == [len(PROMPT_A), len(PROMPT_D)]
    assert all(e["attention"] for e in saved)
    stored, expected = _stored_attention(paths, PROMPT_A), _source_attention(paths, PROMPT_A, queries=16)
    assert stored.shape == (16, len(PROMPT_A))
    torch.testing.assert_close(stored, expected, rtol=1e-4, atol=1e-5)  # the prefill's attention rows

    _store_random_kv(paths, PROMPT_C, tenant="alice")
    _store_random_kv(paths, PROMPT_C, tenant="carol")  # garbage to map: its blocks must never serve as exact
    _store_random_kv(paths, PROMPT_E, tenant="alice", scale=float("nan"))  # a damaged entry on disk

    results = _spawn(
        "consumer",
        paths,
        [
            [(PROMPT_A, "other", None)],
            [(PROMPT_A, "alice", None)],
            [(PROMPT_A, "alice", None)],
            [(PROMPT_B, "alice", None)],
            [(PROMPT_C, "other", None)],
            [(PROMPT_C, "alice", MAP_ONLY_PARAMS)],
            [(PROMPT_A, "alice", {"kvhub_control": True, "kvhub_recompute": ALL_EXACT})],
            [(PROMPT_A, "alice", {"kvhub_control": True, "kvhub_recompute": MAP_ONLY})],
            # two requests in one engine step, each with its own selection
            [
                (PROMPT_A, "alice", {"kvhub_recompute": "exact_budget=0.3,select=target,spans=token"}),
                (PROMPT_D, "alice", {"kvhub_recompute": "exact_budget=0.2,select=random,spans=token"}),
            ],
            [(PROMPT_D, "other", None)],
            [(PROMPT_E, "other", None)],
            [(PROMPT_E, "alice", None)],
            # by the small model's attention, which the producer stored; C's entry has none: select=target
            [(PROMPT_A, "alice", {"kvhub_recompute": "exact_budget=0.3,select=source,spans=token"})],
            [(PROMPT_C, "alice", {"kvhub_recompute": "exact_budget=0.3,select=source,spans=token"})],
            # settling: carol's escalation over garbage KV, then her own exact prefill of the same prompt
            # (kvhub_prefill), then a longer prompt that hits that prefill in vLLM's prefix cache
            [(PROMPT_C, "carol", MAP_ONLY_PARAMS)],
            [(PROMPT_C, "carol", {"kvhub_prefill": True})],
            [(PROMPT_C_LONGER, "carol", {"kvhub_prefill": True})],
            [(PROMPT_C_LONGER, "other", None)],
        ],
    )
    (
        (own,),
        (mapped,),
        (again,),
        (unseen,),
        (own_c,),
        (random_c,),
        (control_all,),
        (control_map,),
        (pair_a, pair_d),
        (own_d,),
        (own_e,),
        (damaged_e,),
        (source_a,),
        (source_c,),
        (garbage_c,),
        (settle_c,),
        (settled_longer,),
        (own_longer,),
    ) = results
    events = [e for e in _events(paths) if e["role"] == "consumer"]
    decisions = [e for e in events if e["event"] in ("hit", "fallback")]
    assert [e["event"] for e in decisions][:4] == ["fallback", "hit", "hit", "fallback"], decisions
    other, first, second, b = decisions[:4]
    assert other["reason"] == "no stored source KV for this prompt"  # tenant isolation
    # 100 prompt tokens, exact suffix 16 -> the stored 80-token prefix, block-aligned to 64 tokens
    assert (first["start"], first["end"]) == (0, 64)
    assert second["local_hit_tokens"] == 0  # the mapped blocks never became vLLM prefix-cache entries
    assert b["reason"] == "no stored source KV for this prompt"
    assert mapped["ids"] == own["ids"], "greedy output from the mapped + recomputed cache differs from the target's own"
    assert again["ids"] == own["ids"]
    # what the load did comes back with the response: the default spec recomputed the first 4
    report = mapped["kvhub"]
    assert report["mapped_tokens"] == 64 and report["prefill_tokens"] == 36, report
    # the 8% budget (8 tokens) is spent by the block rounding of the tail (36 tokens for a suffix of 16)
    assert report["exact_prefix_tokens"] == 4 and report["recomputed_tokens"] == 4 + report["selected_tokens"]
    assert report["selected_tokens"] == _budget(0.08, len(PROMPT_A), 64) == 0
    # counted from the positions: the 4 recomputed and vLLM's tail [64, 99) (the last prompt token is not context)
    assert report["exact_tokens"] == 39 and report["exact_fraction"] == 39 / 99
    assert report["deshrink"] == "kv"  # how the maps were read: the default
    assert random_c["ids"] != own_c["ids"], "the output ignores the mapped KV"
    # the masked pass alone reproduces a prefill: the control map, every mapped token recomputed
    assert control_all["kvhub"]["recomputed_tokens"] == 64 and control_all["ids"] == own["ids"]
    assert control_all["kvhub"]["exact_tokens"] == 99
    assert control_map["kvhub"]["recomputed_tokens"] == 0 and control_map["ids"] != own["ids"]
    assert control_map["kvhub"]["exact_tokens"] == 35
    # one step, two selections
    assert pair_a["kvhub"]["selected_tokens"] == _budget(0.3, len(PROMPT_A), 64) == 10
    assert pair_d["kvhub"]["selected_tokens"] == _budget(0.2, len(PROMPT_D), 64) == 8
    assert pair_a["ids"] == own["ids"] and pair_d["ids"] == own_d["ids"]
    # a damaged entry (NaN on disk) is refused by the load: it falls back, visibly, and vLLM prefills
    assert "NaN" in damaged_e["kvhub"]["fallback"], damaged_e
    assert damaged_e["ids"] == own_e["ids"]
    assert any(e["event"] == "fallback" and "NaN" in e.get("reason", "") for e in events)
    # select=source: the stored attention chooses, the budget is the same, the output the target's own
    assert source_a["kvhub"]["selected_tokens"] == 10 and "select_fallback" not in source_a["kvhub"], source_a
    assert source_a["ids"] == own["ids"]
    assert source_c["kvhub"]["select_fallback"].startswith("no source attention"), source_c
    assert source_c["kvhub"]["selected_tokens"] == 10
    # kvhub_prefill loads nothing; the blocks vLLM computed over carol's garbage map (its tail [64, 96)) lost
    # their hashes, so the longer prompt's 96-token prefix hit is her exact prefill's, and its output the own
    assert garbage_c["kvhub"]["mapped_tokens"] == 64 and garbage_c["ids"] != own_c["ids"]
    assert settle_c["kvhub"]["fallback"] == "prefill" and "kvhub_prefill" in settle_c["kvhub"]["reason"]
    assert settle_c["ids"] == own_c["ids"]
    assert settled_longer["kvhub"]["prefill_tokens"] == len(PROMPT_C_LONGER) - 96, settled_longer
    assert settled_longer["ids"] == own_longer["ids"]


@pytest.mark.vllm
@needs_vllm
def test_a_failed_recompute_falls_back_to_prefill_and_the_pass_matches_transformers(tmp_path):
    """A recompute that raises inside the engine: vLLM prefills the request (its output is own) and the
    events say why.  A load and recompute followed by a chunked prefill of the tail.  Then the
    connector's pass over the engine's model against kvhub.serving.recompute's in transformers, on the
    same cache and positions (fp32)."""
    paths = make_family(tmp_path)
    _store_random_kv(paths, PROMPT_A, tenant="alice")  # any stored KV: the load fails in its recompute
    _store_random_kv(paths, PROMPT_D, tenant="alice")
    results = _spawn(
        "consumer",
        paths,
        [
            [(PROMPT_A, "other", None)],
            [(PROMPT_A, "alice", None)],
            [(PROMPT_D, "other", None)],
            [(PROMPT_D, "alice", {"kvhub_control": True, "kvhub_recompute": ALL_EXACT})],
        ],
        env={
            "KVHUB_TEST_FAIL_RECOMPUTE": str(len(PROMPT_A)),
            "KVHUB_TEST_COMPARE_PASS": "1",
            "KVHUB_TEST_MAX_BATCHED": "16",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        },
    )
    (own,), (failed,), (own_d,), (chunked_d,), differences = results
    assert failed["kvhub"]["fallback"] == "RuntimeError: planted recompute failure", failed
    assert failed["ids"] == own["ids"]
    # chunked prefill (16 tokens a step): the 26-token tail after a load and a full recompute is a prefill
    assert chunked_d["kvhub"]["recomputed_tokens"] == 64 and chunked_d["kvhub"]["prefill_tokens"] == 26
    assert chunked_d["ids"] == own_d["ids"]
    reasons = [e["reason"] for e in _events(paths) if e["role"] == "consumer" and e["event"] == "fallback"]
    assert "load failed: RuntimeError: planted recompute failure" in reasons
    worst = max(differences)
    assert worst < 1e-4, f"engine pass and transformers' recompute differ by {worst}"


def compare_engine_pass(worker, target_path: str) -> float:
    """On the engine's worker: max |K/V difference| between the engine pass and recompute_positions (module
    docstring of kvhub.serving.engine_pass) over a random cache of 40 tokens, recomputing 9 of them."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from kvhub.serving.engine_pass import EnginePass
    from kvhub.serving.recompute import recompute_positions

    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    config = target.config
    heads, dim, layers = config.num_key_value_heads, config.head_dim, config.num_hidden_layers
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 121, (1, 40), generator=generator)
    cached = [
        (torch.randn(heads, 40, dim, generator=generator), torch.randn(heads, 40, dim, generator=generator))
        for _ in range(layers)
    ]
    cache = DynamicCache()
    for index, (k, v) in enumerate(cached):
        cache.update(k[None].clone(), v[None].clone(), index)
    positions = torch.tensor([0, 1, 2, 3, 11, 12, 20, 30, 31])
    recompute_positions(target, cache, ids, positions)
    engine = EnginePass(worker.get_model())
    fresh = engine.run(ids[0, positions], positions, lambda i: cached[i]).fresh
    return max(
        max(
            float((k - layer.keys[0, :, positions].transpose(0, 1)).abs().max()),
            float((v - layer.values[0, :, positions].transpose(0, 1)).abs().max()),
        )
        for (k, v), layer in zip(fresh, cache.layers)
    )


def _stored_attention(paths: dict, prompt: list[int]):
    """The source attention the producer stored with ``prompt``'s KV (tenant alice)."""
    from kvhub.serving import KVStore

    store = KVStore(paths["kvstore"], max_bytes=64 << 20)
    found = store.longest_prefix(isolation_key="alice", source_model="tiny/src", token_ids=prompt)
    assert found is not None and found.tokens == len(prompt) - len(prompt) % 16
    return store.read_attention(found.entry, token_ids=prompt, end=len(prompt))


def _source_attention(paths: dict, prompt: list[int], *, queries: int):
    """(queries, T) attention of the prompt's last tokens, averaged over layers and heads, by transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    source = AutoModelForCausalLM.from_pretrained(paths["source"], dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        out = source(torch.tensor([prompt]), output_attentions=True)
    return torch.stack([layer[0, :, -queries:] for layer in out.attentions]).mean((0, 1))


def _store_random_kv(paths: dict, prompt: list[int], *, tenant: str, scale: float = 3.0) -> None:
    """Random source KV for ``prompt``; a non-finite ``scale`` plants a damaged entry (as a disk fault would
    leave it: ``KVStore.put`` itself refuses Inf/NaN, so its check is bypassed for this one write)."""
    import math

    import torch

    from kvhub.serving import KVStore, kvstore

    store = KVStore(paths["kvstore"], max_bytes=64 << 20)
    noise = [torch.randn(2, len(prompt), 32) * scale for _ in range(2 * 3)]  # the source's 3 layers x (H=2, T, D=32)
    check = kvstore.check_layers
    if not math.isfinite(scale):
        kvstore.check_layers = lambda keys, values, tokens: None
    try:
        store.put(isolation_key=tenant, source_model="tiny/src", token_ids=prompt, keys=noise[:3], values=noise[3:])
    finally:
        kvstore.check_layers = check


def _plant_recompute_failure(prompt_tokens: int) -> None:
    """The recompute of every prompt of ``prompt_tokens`` tokens raises (the engine runs in this process:
    VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    from kvhub.serving import engine_pass

    real = engine_pass.recompute_request

    def planted(engine, spec, *, prompt_ids, **kwargs):
        if len(prompt_ids) == prompt_tokens:
            raise RuntimeError("planted recompute failure")
        return real(engine, spec, prompt_ids=prompt_ids, **kwargs)

    engine_pass.recompute_request = planted


if __name__ == "__main__":
    role, paths, requests, out = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
    if os.environ.get("KVHUB_TEST_FAIL_RECOMPUTE"):
        _plant_recompute_failure(int(os.environ["KVHUB_TEST_FAIL_RECOMPUTE"]))
    Path(out).write_text(json.dumps(run_engine(role, paths, requests)))


@pytest.mark.vllm
def test_the_transfer_config_kvhub_serve_builds_is_the_one_vllm_builds(tmp_path):
    """What ``kvhub serve`` hands vLLM (launch.transfer_configs, as JSON on the command line) goes through vLLM's
    own ``KVTransferConfig`` unchanged for both roles, and the extra config vLLM then holds reads back into the
    same typed ConnectorConfig the connector builds.  Planted bugs caught: a key vLLM drops or renames, a
    role name vLLM does not know, an extra-config value vLLM coerces to another type (a number as text)."""
    from vllm.config import KVTransferConfig

    from kvhub.serving.connector_config import read_config
    from kvhub.serving.launch import CONNECTOR_CLASS, CONNECTOR_MODULE, transfer_configs

    configs = transfer_configs(
        kvstore_dir=tmp_path / "kv", source_model="tiny/src", mapper="src:dst:tiny-calib@latest",
        exact_budget=0.1, select="source", kvstore_max_bytes=1 << 20, min_escalation_tokens=64,
    )  # fmt: skip
    for role, config in configs.items():
        built = KVTransferConfig(**json.loads(json.dumps(config)))  # as `vllm serve --kv-transfer-config` reads it
        assert (built.kv_connector, built.kv_connector_module_path) == (CONNECTOR_CLASS, CONNECTOR_MODULE)
        assert built.kv_role == config["kv_role"] and built.kv_role in ("kv_producer", "kv_consumer"), role
        assert built.kv_connector_extra_config == config["kv_connector_extra_config"], role
        assert read_config(built.kv_connector_extra_config) == read_config(config["kv_connector_extra_config"])
