"""Time to first token of the large model inside vLLM: kvhub connector vs plain prefill, side by side.

    bash scripts/setup-vllm.sh                       # once: .venv-vllm with vLLM's CPU build
    kvhub fetch models                               # once: the real pair, converted locally
    .venv-vllm/bin/python benchmarks/vllm_ttft.py \\
        --src Qwen/Qwen2.5-Coder-0.5B-Instruct --dst Qwen/Qwen2.5-Coder-1.5B-Instruct \\
        --mapper qwen2.5-coder-0.5b-instruct:qwen2.5-coder-1.5b-instruct:legal-docs@production \\
        --out docs/results/vllm_ttft.json              # the break-even curve: 512, 1k, 2k, 4k, 8k tokens
    .venv-vllm/bin/python benchmarks/vllm_ttft.py --tiny /tmp/kvhub-tiny --lengths 128 200   # smoke test

Two engine processes run one after the other (vLLM spawns its engine, so each is a subprocess):
1. producer, the small model with the connector as kv_producer: prefills each prompt once (1 token), which
   stores its KV; its time is reported but is not part of the large model's TTFT (in a cascade the small
   model has already read the conversation);
2. consumer, the large model with the connector as kv_consumer (and kvhub's worker class, so the
   recompute runs): for each length, TTFT (wall time of a 1-token request, median of --repeats) of plain
   prefill (a tenant with no stored KV, so the connector falls back), of the connector mapping only (the
   request's own spec "exact_prefix=0,exact_budget=0": vLLM computes the suffix), of the connector's
   default (map + the first 4 + 8% selected by the small model's attention, which the producer stored,
   recomputed) and of the same budget selected by the large model's attention over the mapped cache
   (``recompute_target``: one selection pass more), alternating;
   then greedy generation of --new-tokens each way for agreement with the large model's own.  ``load``
   is what the connector reported for the request (response kv_transfer_params["kvhub"]: mapped,
   recomputed and prefilled token counts).  Each prompt uses its own cache_salt, so vLLM's prefix cache
   never serves one measurement from another; a short warm-up request goes first.  The consumer runs with
   min_escalation_tokens=0, so every length is escalated: the curve is what sets that threshold.

``curve`` in the result: each mode's TTFT speedup over plain prefill per length, and ``pays_from``, the
shortest measured length from which on every longer one escalating is faster than prefilling (None: not
even at the longest); docs/serving.md, Short prompts.

Prompts are --text tokenized with the source tokenizer (repeated to length), else seeded random ids.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _prompts(args, vocab: int) -> dict[int, list[int]]:
    if args.text:
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(args.src_path).encode(Path(args.text).read_text())
        if not ids:
            raise SystemExit(f"{args.text} tokenizes to nothing")
        return {n: (ids * (n // len(ids) + 1))[:n] for n in args.lengths}
    import random

    rng = random.Random(args.seed)
    return {n: [rng.randrange(10, vocab - 10) for _ in range(n)] for n in args.lengths}


def _transfer(args, role: str) -> dict:
    from kvhub.serving.launch import transfer_configs

    configs = transfer_configs(
        kvstore_dir=args.kvstore_dir,
        source_model=args.source_model,
        mapper=args.mapper,
        mapper_path=None if args.mapper else args.mapper_path,
        db=args.db,
        exact_suffix=args.exact_suffix,
        exact_budget=args.exact_budget,
        kvstore_max_bytes=args.kvstore_max_bytes,
        min_escalation_tokens=0,
        events_path=str(Path(args.kvstore_dir) / "events.jsonl"),
    )
    return configs[role]


def run_engine(args, role: str) -> dict:
    """Inside the engine subprocess: run the role's requests, return timings and outputs."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    model = args.src_path if role == "producer" else args.dst_path
    options = dict(
        model=model,
        dtype=args.dtype,
        max_model_len=max(args.lengths) + args.new_tokens + 16,
        enforce_eager=True,
        enable_prefix_caching=True,
        max_num_batched_tokens=max(args.lengths) + 64,
        kv_transfer_config=KVTransferConfig(**_transfer(args, role)),
    )
    from kvhub.serving.launch import WORKER_CLASS

    options["worker_cls"] = WORKER_CLASS  # the model reaches the recompute and the producer's source attention
    if args.block_size:
        options["block_size"] = args.block_size
    if args.tiny:
        options["skip_tokenizer_init"] = True
    llm = LLM(**options)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    prompts = _prompts(args, vocab)

    def generate(ids, salt, tokens, recompute=None):
        extra = {"kv_transfer_params": {"kvhub_recompute": recompute}} if recompute else None
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False, extra_args=extra)
        started = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids, cache_salt=salt)], params, use_tqdm=False)
        report = (out[0].kv_transfer_params or {}).get("kvhub") or {}
        return time.perf_counter() - started, list(out[0].outputs[0].token_ids), report

    generate(prompts[min(args.lengths)][:32], "warmup", 1)
    results = {}
    for n, ids in prompts.items():
        if role == "producer":
            results[n] = {"producer_prefill_s": generate(ids, f"bench-{n}", 1)[0]}
            continue
        times = {"prefill": [], **{mode: [] for mode in MODES}}
        reports = {}
        for repeat in range(args.repeats):  # mapped blocks never enter the prefix cache, so each repeat maps again
            times["prefill"].append(generate(ids, f"prefill-ttft-{n}-{repeat}", 1)[0])
            for mode, spec in MODES.items():
                seconds, _, reports[mode] = generate(ids, f"bench-{n}", 1, spec)
                times[mode].append(seconds)
        _, own, _ = generate(ids, f"prefill-gen-{n}", args.new_tokens)
        row = {
            "new_tokens": args.new_tokens,
            "prefill_ttft_s": statistics.median(times["prefill"]),
            "prefill_ttft_all_s": times["prefill"],
        }
        for mode, spec in MODES.items():
            _, escalated, _ = generate(ids, f"bench-{n}", args.new_tokens, spec)
            median = statistics.median(times[mode])
            row[mode] = {
                "ttft_s": median,
                "ttft_all_s": times[mode],
                "speedup": row["prefill_ttft_s"] / median,
                "load": reports[mode],
                "greedy_identical": own == escalated,
                "greedy_agree_prefix": next((i for i, (a, b) in enumerate(zip(own, escalated)) if a != b), len(own)),
            }
        results[n] = row
    return results


MAP_ONLY = "exact_prefix=0,exact_budget=0"  # a request's own recompute spec: map only (vLLM computes the suffix)
MODES = {  # mode -> the request's own recompute spec (None: the engine's default, select=source)
    "map_only": MAP_ONLY,
    "recompute": None,
    "recompute_target": "select=target",  # the same budget, chosen by the large model's selection pass
}


def break_even(lengths: dict[int, dict]) -> dict:
    """{mode: {"speedup": {n: x}, "pays_from": n or None}} over the consumer's rows: ``pays_from`` is the shortest
    measured n such that the mode beats plain prefill (speedup > 1) at n and at every longer measured length."""
    curve = {}
    for mode in MODES:
        if any(mode not in row for row in lengths.values()):
            continue
        speedups = {n: round(lengths[n][mode]["speedup"], 2) for n in sorted(lengths)}
        pays_from = None
        for n in sorted(speedups, reverse=True):
            if speedups[n] <= 1:
                break
            pays_from = n
        curve[mode] = {"speedup": speedups, "pays_from": pays_from}
    return curve


def _spawn(args, role: str) -> dict:
    out = Path(args.kvstore_dir) / f"{role}-result.json"
    command = [
        sys.executable,
        __file__,
        *sys.argv[1:],
        "--engine",
        role,
        "--engine-out",
        str(out),
        "--kvstore-dir",
        args.kvstore_dir,
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib),
    }  # CPU backend: KV cache size, instead of a memory share
    subprocess.run(command, check=True, env=env)
    return json.loads(out.read_text())


def _tiny(args) -> None:
    """Build the tiny exact family (tests/serving/test_vllm_connector.py) and point the arguments at it."""
    sys.path.insert(0, str(ROOT))
    from tests.serving.test_vllm_connector import make_family

    directory = Path(args.tiny)
    paths = (
        make_family(directory)
        if not (directory / "dst").exists()
        else {"source": str(directory / "src"), "target": str(directory / "dst"), "db": str(directory / "kvhub.db")}
    )
    args.src_path, args.dst_path, args.db = paths["source"], paths["target"], paths["db"]
    args.mapper, args.source_model, args.dtype = "src:dst:tiny-calib@latest", "tiny/src", "float32"


def _resolve(args) -> None:
    if args.tiny:
        return _tiny(args)
    from kvhub.models.loading import resolve_model_path

    args.src_path, args.dst_path = str(resolve_model_path(args.src)), str(resolve_model_path(args.dst))
    args.source_model = args.source_model or args.src


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", default="Qwen/Qwen2.5-Coder-0.5B-Instruct")
    parser.add_argument("--dst", default="Qwen/Qwen2.5-Coder-1.5B-Instruct")
    parser.add_argument("--mapper", help="mapper reference SRC:DST:CALIB@SELECTOR (kvhub.load)")
    parser.add_argument("--mapper-path", help="or an artifact directory")
    parser.add_argument("--db", help="kvhub store (default: kvhub's own)")
    parser.add_argument("--source-model", help="the source model's name in the KV store (default: --src)")
    parser.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=[512, 1024, 2048, 4096, 8192],
        help="prompt lengths in tokens (default: the break-even curve)",
    )
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="TTFT measurements per length and mode (median)")
    parser.add_argument("--exact-suffix", type=int, default=16, help="prompt tokens vLLM always computes itself")
    parser.add_argument(
        "--exact-budget",
        type=float,
        default=None,
        help="the consumer's recompute budget (default: the connector's, 0.08)",
    )
    parser.add_argument("--block-size", type=int, help="vLLM block size (default: vLLM's)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--text", help="a text file for the prompts (default: seeded random token ids)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kvstore-dir", help="KV store directory (default: a fresh temp dir)")
    parser.add_argument("--kvstore-max-bytes", type=int, default=4 << 30)
    parser.add_argument("--kv-cache-gib", type=int, default=4, help="vLLM CPU KV cache size per engine (GiB)")
    parser.add_argument("--tiny", help="smoke test: build the tiny exact family in this directory and use it")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--engine", choices=["producer", "consumer"], help=argparse.SUPPRESS)
    parser.add_argument("--engine-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not (args.mapper or args.mapper_path or args.tiny):
        parser.error("give --mapper or --mapper-path (or --tiny)")
    args.kvstore_dir = args.kvstore_dir or tempfile.mkdtemp(prefix="kvhub-ttft-")
    _resolve(args)
    if args.engine:
        Path(args.engine_out).write_text(json.dumps(run_engine(args, args.engine)))
        return
    producer = _spawn(args, "producer")
    consumer = _spawn(args, "consumer")
    report = {
        "src": args.src_path,
        "dst": args.dst_path,
        "mapper": args.mapper or args.mapper_path,
        "dtype": args.dtype,
        "exact_suffix": args.exact_suffix,
        "exact_budget": args.exact_budget,
        "cpu_threads": os.cpu_count(),
        "lengths": {str(n): {**producer[str(n)], **consumer[str(n)]} for n in args.lengths},
        "curve": break_even({n: consumer[str(n)] for n in args.lengths}),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
