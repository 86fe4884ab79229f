"""End to end with the real vLLM engine (CPU build): producer on a tiny source model, consumer on its exact
target (tests/tinymodels.py: the target computes exactly the source's function, so a correct map gives the
target's own greedy output).

Run with scripts/test-vllm.sh (needs .venv-vllm from scripts/setup-vllm.sh).  vLLM spawns its engine
process, so each engine runs in a subprocess of this file (``python tests/test_vllm_connector.py ROLE``),
one for the producer and one for the consumer; the consumer's requests, in order:

1. prompt A as tenant "other" (cache_salt): no stored KV in that namespace -> fallback; this is the big
   model's own output for A (and shows another tenant gets no hit);
2. prompt A as tenant "alice": the producer's KV, mapped -> must equal 1.;
3. prompt A as "alice" again: vLLM's own prefix cache must not hit the mapped blocks (local hit 0);
4. prompt B as "alice": never produced -> fallback;
5. prompt C as "other", then as "alice" after the test stored random KV for it: the engine really reads
   what was mapped (the control: its output must differ from C's own).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 32
PROMPT_A = [(7 * i + 3) % 120 + 1 for i in range(100)]
PROMPT_B = [(11 * i + 5) % 120 + 1 for i in range(90)]
PROMPT_C = [(13 * i + 2) % 120 + 1 for i in range(100)]
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

    from kvhub.fitting.fit import FitOptions, fit
    from kvhub.store import open_store
    from tests.tinymodels import exact_family_target, make_model

    source = make_model("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                        num_hidden_layers=3)  # head_dim 32; the target's is 64: both CPU-backend sizes
    target, _ = exact_family_target(source, insert_before=(1,), kv_repeat=2, double_head_dim=True)
    paths = {"source": directory / "src", "target": directory / "dst", "db": directory / "kvhub.db",
             "store": directory / "kvstore", "events": directory / "events.jsonl"}
    for name in ("source", "target"):
        model = source if name == "source" else target
        model.config.eos_token_id = None
        model.save_pretrained(paths[name])
    ids = torch.randint(1, 121, (32, 48), generator=torch.Generator().manual_seed(0))
    heldout = torch.randint(1, 121, (8, 48), generator=torch.Generator().manual_seed(1))
    mapper = fit(source, target, ids, heldout, source_id="tiny/src", target_id="tiny/dst",
                 calibration={"name": "tiny-calib", "version": "1", "content_hash": "0" * 64,
                              "tokens": int(ids.numel())},
                 options=FitOptions(top_k="auto", ridge_lambda=1e-9, stride=1, batch_size=8))
    mapper.save(directory / "artifact")
    with open_store(str(paths["db"])) as store:
        store.register(directory / "artifact")
    return {name: str(path) for name, path in paths.items()}


def _transfer_config(paths: dict, role: str) -> dict:
    from kvhub.serving.launch import transfer_configs

    return transfer_configs(store_dir=paths["store"], source_model="tiny/src", mapper="src:dst:tiny-calib@latest",
                            db=paths["db"], events_path=paths["events"], store_max_bytes=64 << 20)[role]


def run_engine(role: str, paths: dict, requests: list[tuple[list[int], str]]) -> list[list[int]]:
    """Greedy outputs of ``requests`` (prompt ids, cache_salt), one at a time, on the role's model."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    # the producer prefills in 64-token chunks: its prompt KV is saved from blocks filled over two steps
    chunk = {"max_num_batched_tokens": 64} if role == "producer" else {}
    llm = LLM(model=paths["source" if role == "producer" else "target"], skip_tokenizer_init=True,
              dtype="float32", block_size=BLOCK, max_model_len=256, max_num_seqs=4, enforce_eager=True,
              enable_prefix_caching=True, kv_transfer_config=KVTransferConfig(**_transfer_config(paths, role)),
              **chunk)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
    outputs = []
    for prompt, salt in requests:
        result = llm.generate([TokensPrompt(prompt_token_ids=prompt, cache_salt=salt)], params, use_tqdm=False)
        outputs.append(list(result[0].outputs[0].token_ids))
    return outputs


def _spawn(role: str, paths: dict, requests, timeout: int = 900) -> list[list[int]]:
    out = Path(paths["events"]).with_name(f"{role}-outputs.json")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, __file__, role, json.dumps(paths), json.dumps(requests), str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"{role} engine failed (rc {done.returncode}):\n{done.stderr[-6000:]}")
    return json.loads(out.read_text())


def _events(paths: dict) -> list[dict]:
    return [json.loads(line) for line in Path(paths["events"]).read_text().splitlines()]


@pytest.mark.vllm
@pytest.mark.skipif(not _engine_available(), reason="vLLM is not installed (scripts/setup-vllm.sh)")
def test_consumer_maps_producer_kv_into_vllm_blocks(tmp_path):
    paths = make_family(tmp_path)
    produced = _spawn("producer", paths, [(PROMPT_A, "alice")])
    assert len(produced[0]) == NEW_TOKENS
    saved = [e for e in _events(paths) if e["event"] == "saved"]
    assert [e["tokens"] for e in saved] == [len(PROMPT_A)]

    _store_random_kv(paths, PROMPT_C, tenant="alice")

    own, mapped, again, unseen, own_c, random_c = _spawn("consumer", paths, [
        (PROMPT_A, "other"), (PROMPT_A, "alice"), (PROMPT_A, "alice"), (PROMPT_B, "alice"),
        (PROMPT_C, "other"), (PROMPT_C, "alice")])
    events = [e for e in _events(paths) if e["role"] == "consumer"]
    decisions = [e for e in events if e["event"] in ("hit", "fallback")]
    assert [e["event"] for e in decisions] == ["fallback", "hit", "hit", "fallback", "fallback", "hit"], decisions
    other, first, second, b = decisions[:4]
    assert other["reason"] == "no stored source KV for this prompt"  # tenant isolation
    # 100 prompt tokens, exact tail 16 -> the stored 80-token prefix, block-aligned to 64 tokens
    assert (first["start"], first["end"]) == (0, 64)
    assert second["local_hit_tokens"] == 0  # the mapped blocks never became vLLM prefix-cache entries
    assert b["reason"] == "no stored source KV for this prompt"
    assert [e["event"] for e in events].count("mapped") == 3
    assert [e["layers"] for e in events if e["event"] == "written"] == [4, 4, 4]  # every target layer, each load
    assert mapped == own, "greedy output from the mapped cache differs from the target's own"
    assert again == own
    assert random_c != own_c, "the output ignores the mapped KV"


def _store_random_kv(paths: dict, prompt: list[int], *, tenant: str) -> None:
    import torch

    from kvhub.serving import KVStore

    store = KVStore(paths["store"], max_bytes=64 << 20)
    noise = [torch.randn(2, len(prompt), 32) * 3 for _ in range(2 * 3)]  # the source's 3 layers x (H=2, T, D=32)
    store.put(isolation_key=tenant, source_model="tiny/src", token_ids=prompt, keys=noise[:3], values=noise[3:])


if __name__ == "__main__":
    role, paths, requests, out = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
    Path(out).write_text(json.dumps(run_engine(role, paths, [(p, s) for p, s in requests])))
