"""Escalation time to first token on one GPU: the library handoff (map + the default recompute) against the
target's own prefill, side by side, at 7B and 32B shapes (issue 34, item 7; issue 45: before and after).

    python benchmarks/gpu_escalation.py --out "$OUT/gpu_escalation.json"        # one H200: under 8 minutes
    python benchmarks/gpu_escalation.py --tiny --out /tmp/gpu_escalation.json    # the same code, tiny configs, CPU

On a device where kvhub is not installed (nothing can be fetched there), run it from a checkout with
``PYTHONPATH=.`` after ``ln -s ../registry kvhub/_registry`` (the package data an install provides).

Pairs (:data:`PAIRS`): Qwen2.5-Coder-0.5B and -1.5B -> a Qwen2.5-7B-shaped target (:data:`QWEN25_7B`, the
published config's shape), and Qwen3-14B -> Qwen3-32B (the configs kvhub ships).  **Every model has random
weights of the real config, and every mapper random weights with k=4 sources per target layer**: the
device cannot download weights, and what is timed (shapes, kernels, the recompute's token counts) does
not depend on them; the JSON says so in ``weights``.  The selection (select=source) then picks arbitrary
spans of the same budget: the timing of a real selection, not its choice.

Per pair and context length n, after one warm-up of each, ``--repeats`` alternating samples of:

- ``own``: the target's prefill of the whole prompt to its first logits (``target(ids, logits_to_keep=1)``);
- ``escalation``: :func:`kvhub.serving.handoff.escalate` with the handoff's default spec
  (:data:`kvhub.serving.spec.HANDOFF`: the first 4 and last 16 tokens and 8% of the context chosen by the
  source's attention, recomputed by the target over the mapped rest) from the source cache a cascade
  already holds and the attention its prefill collected: one target pass, which also yields the first logits;
- ``before``: the escalation as it was before issue 45 (``benchmarks/escalation_ops.py``'s ``before``: a
  second source pass to select, the per-layer map, the appended masked pass, a separate first-token forward);
- ``map_only``: ``mapper.transfer`` of the same source cache (no recompute, no logits).

``operators``: what one run of each dispatches (``escalation_ops.count``; on a GPU, an upper bound on its
kernel launches).  ``source_prefill_s`` (what the cascade paid before escalating) and ``scoring_s`` (what
collecting the selection's attention adds to that prefill) are timed once.  Times are CUDA events
(perf_counter on a CPU).  A pair or length that would start past ``--budget-s`` is recorded as skipped, so
the run ends in time.  Nothing in kvhub imports this script; tests/serving/test_gpu_escalation_script.py runs it
with --tiny so it cannot rot.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from escalation_ops import before, count  # the two-pass escalation of issue 45, and the operator counter
from gpu_scale import Timer, build_model, random_mapper  # the same model builder and timer

# Qwen2.5-7B(-Instruct / -Coder) config.json, the fields that shape the model (kvhub ships no 7B config)
QWEN25_7B = {
    "_name_or_path": "Qwen/Qwen2.5-7B-Instruct",
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "sliding_window": 131072,
    "max_window_layers": 28,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
PAIRS = {  # name -> (source, target): a config kvhub ships, or a config dict
    "qwen2.5-0.5b->7b": ("Qwen/Qwen2.5-Coder-0.5B-Instruct", QWEN25_7B),
    "qwen2.5-1.5b->7b": ("Qwen/Qwen2.5-Coder-1.5B-Instruct", QWEN25_7B),
    "qwen3-14b->32b": ("Qwen/Qwen3-14B", "Qwen/Qwen3-32B"),
}
TINY = {
    "num_hidden_layers": 3,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
WEIGHTS_NOTE = (
    "random weights of the real configs (no download on the device) and random k=4 mappers: "
    "the times are real, the selection's choice and the outputs are not"
)


def config_of(spec, *, tiny: bool, depth: int = 0) -> dict:
    """The config dict of ``spec`` (a shipped model id or a dict); with ``tiny``, scaled down (targets deeper)."""
    from kvhub.fitting.plan import load_config

    config = dict(spec) if isinstance(spec, dict) else dict(load_config(spec)[0])
    if tiny:
        config.update(TINY, num_hidden_layers=TINY["num_hidden_layers"] + depth)
        config.pop("layer_types", None)  # one per real layer: rebuilt from the scaled depth
        config.pop("pad_token_id", None)  # past the scaled vocabulary
        config["max_window_layers"] = config["num_hidden_layers"]
        if config.get("model_type") == "qwen2":
            config.pop("head_dim", None)
    return config


def model_name(spec) -> str:
    return spec["_name_or_path"] if isinstance(spec, dict) else spec


def named_mapper(source, target, names: tuple[str, str], *, device):
    mapper = random_mapper(source, target, k=min(4, source.config.num_hidden_layers), seed=0, device=device)
    for side, name in zip(("source", "target"), names):
        mapper.metadata[side]["model_id"] = name
    return mapper


def escalate(mapper, source, target, ids: torch.Tensor, source_cache, attention) -> int:
    """The library escalation to the target's first logits (:func:`kvhub.serving.handoff.escalate`: one target
    pass, selection from the attention the source's prefill collected); returns the context positions
    recomputed."""
    from kvhub.serving.handoff import escalate as library_escalate
    from kvhub.serving.spec import HANDOFF

    done = library_escalate(
        mapper, source, target, ids, recompute=HANDOFF.capped(ids.shape[1] - 1), source_cache=source_cache,
        source_attention=attention,
    )  # fmt: skip
    return int(done.positions.numel())


def scored_prefill(source, context: torch.Tensor):
    """(the source's cache of ``context``, the attention its last queries paid): the prefill a serving stack
    runs before it escalates, collecting the selection's scores as it goes."""
    from kvhub.core.capture import run_model
    from kvhub.core.last_queries import LastQueryAttention
    from kvhub.serving.recompute import selection_queries
    from kvhub.serving.spec import HANDOFF

    spec = HANDOFF.capped(context.shape[1])
    with LastQueryAttention(source, queries=selection_queries(spec, context.shape[1])) as scored:
        cache = run_model(source, context)
    return cache, scored.attention[0]


def phases(mapper, source, target, ids: torch.Tensor, source_cache, attention, timer) -> dict:
    """Seconds of each step of one escalation, in :func:`kvhub.serving.handoff.escalate`'s order (the windowed
    and full-prefill branches aside): ``transfer`` (the map); ``select`` (the span choice from the prefill's
    attention); ``recompute`` (one target pass: the recomputed positions and the last token's first logits)."""
    from kvhub.serving.recompute import recompute_positions, recompute_set
    from kvhub.serving.spec import HANDOFF

    context = ids[:, :-1]
    spec = HANDOFF.capped(context.shape[1])
    held: dict = {}
    out = {"transfer": timer(lambda: held.update(cache=mapper.transfer(source_cache, dtype=target.dtype)))}
    select = dict(context=context, mapped_cache=held["cache"], source_model=source, target_model=target)
    out["select"] = timer(
        lambda: held.update(
            positions=recompute_set(spec, source_cache=source_cache, source_attention=attention, **select)
        )
    )
    out["recompute"] = timer(
        lambda: recompute_positions(target, held["cache"], context, held["positions"], last=ids[:, -1:])
    )
    return out


def trace(mapper, source, target, ids: torch.Tensor, source_cache, attention, path: Path) -> None:
    """torch.profiler's table of one escalation (operators by self device time, then by CPU time) to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ids.is_cuda else [])
    with profile(activities=activities) as prof:
        escalate(mapper, source, target, ids, source_cache, attention)
        if ids.is_cuda:
            torch.cuda.synchronize()
    table = prof.key_averages()
    by_device = "self_cuda_time_total" if ids.is_cuda else "self_cpu_time_total"
    path.write_text(
        f"one escalation, {ids.shape[1]} tokens\n\n"
        + table.table(sort_by=by_device, row_limit=30)
        + "\n\n"
        + table.table(sort_by="cpu_time_total", row_limit=30)
    )


def measure_length(mapper, source, target, *, length: int, repeats: int, device, trace_to: Path | None = None) -> dict:
    from kvhub.core.capture import run_model
    from kvhub.serving.spec import HANDOFF

    vocab = min(source.config.vocab_size, target.config.vocab_size)
    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(length)).to(device)
    timer = Timer(device)
    holder = {}
    source_prefill = timer(lambda: holder.update(cache=run_model(source, ids[:, :-1])))
    scored_prefill_s = timer(lambda: holder.update(scored=scored_prefill(source, ids[:, :-1])))
    source_cache, attention = holder.pop("scored")
    counts = []
    spec = HANDOFF.capped(length - 1)
    ops = {
        "own": lambda: target(input_ids=ids, logits_to_keep=1),
        "escalation": lambda: counts.append(escalate(mapper, source, target, ids, source_cache, attention)),
        "before": lambda: before(mapper, source, target, ids, source_cache, spec),  # the two-pass path of issue 45
        "map_only": lambda: mapper.transfer(source_cache, dtype=target.dtype),
    }
    for fn in ops.values():
        fn()  # warm-up
    samples = {name: [] for name in ops}
    for _ in range(repeats):
        for name, fn in ops.items():  # alternating, so drift hits every condition alike
            samples[name].append(timer(fn))
    row = {
        "tokens": length,
        "source_prefill_s": source_prefill,
        "scoring_s": scored_prefill_s - source_prefill,  # what the selection's scores add to the source's prefill
        "operators": {name: count(fn)[0] for name, fn in ops.items()},  # dispatched ops: launches or host work
        **{f"{name}_median_s": statistics.median(values) for name, values in samples.items()},
        **{f"{name}_s": values for name, values in samples.items()},
    }
    if trace_to is not None:
        trace(mapper, source, target, ids, source_cache, attention, trace_to)
    steps = [phases(mapper, source, target, ids, source_cache, attention, timer) for _ in range(repeats)]
    row["phases_median_s"] = {name: statistics.median(step[name] for step in steps) for name in steps[0]}
    row["recomputed_tokens"] = counts[-1]
    row["exact_fraction"] = (counts[-1] + 1) / (length - 1)  # the recomputed ones and the last token, as handoff counts
    row["speedup"] = row["own_median_s"] / row["escalation_median_s"]
    row["speedup_before"] = row["own_median_s"] / row["before_median_s"]
    row["speedup_map_only"] = row["own_median_s"] / row["map_only_median_s"]
    return row


def run_pair(
    name: str,
    *,
    tiny: bool,
    lengths: list[int],
    repeats: int,
    device,
    dtype,
    started: float,
    budget_s: float,
    out: dict,
    save,
    trace_to: Path | None = None,
) -> dict:
    """Measures one pair into ``out`` (already in the report), calling ``save()`` after each length, so a run
    stopped at its time limit still leaves every length it finished."""
    source_spec, target_spec = PAIRS[name]
    out.update(source=model_name(source_spec), target=model_name(target_spec), lengths=[])
    if time.perf_counter() - started > budget_s:
        out["skipped"] = f"past the {budget_s:.0f} s budget before it started"
        return out
    built = time.perf_counter()
    source = build_model(config_of(source_spec, tiny=tiny), device=device, dtype=dtype, seed=0)
    target = build_model(config_of(target_spec, tiny=tiny, depth=2), device=device, dtype=dtype, seed=1)
    mapper = named_mapper(source, target, (out["source"], out["target"]), device=device)
    out["build_s"] = time.perf_counter() - built
    with torch.no_grad():
        for length in lengths:
            if time.perf_counter() - started > budget_s:
                out["lengths"].append({"tokens": length, "skipped": f"past the {budget_s:.0f} s budget"})
                continue
            traced = trace_to if length == lengths[-1] else None
            out["lengths"].append(
                measure_length(mapper, source, target, length=length, repeats=repeats, device=device, trace_to=traced)
            )
            save()
    del source, target, mapper
    gc.collect()
    if device.type == "cuda":
        out["peak_bytes"] = torch.cuda.max_memory_allocated(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny configs of the same pairs, on the CPU (smoke test)")
    parser.add_argument("--device", default=None, help="default: cuda, or cpu with --tiny")
    parser.add_argument("--pairs", default=",".join(PAIRS), help=f"comma-separated, of {', '.join(PAIRS)}")
    parser.add_argument("--lengths", default=None, help="context lengths [1024,4096,16384; tiny: 48]")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="start no pair or length after this many seconds (the run stays under 8 minutes)",
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="write torch.profiler's table of one escalation (first pair, longest length)",
    )
    args = parser.parse_args(argv)
    from kvhub.dtypes import parse_dtype

    started = time.perf_counter()
    device = torch.device(args.device or ("cpu" if args.tiny else "cuda"))
    lengths = [int(v) for v in (args.lengths or ("48" if args.tiny else "1024,4096,16384")).split(",")]
    names = [n for n in args.pairs.split(",") if n]
    unknown = sorted(set(names) - set(PAIRS))
    if unknown:
        parser.error(f"unknown pairs {unknown}; known: {', '.join(PAIRS)}")
    report = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({torch.get_num_threads()} threads)",
        "tiny": args.tiny,
        "weights": WEIGHTS_NOTE,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "recompute": "handoff default: exact_prefix=4, exact_suffix=16, exact_budget=0.08, select=source",
        "torch": torch.__version__,
        "pairs": {},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        report["wall_s"] = time.perf_counter() - started
        args.out.write_text(json.dumps(report, indent=2) + "\n")

    for index, name in enumerate(names):
        report["pairs"][name] = {}
        run_pair(
            name,
            tiny=args.tiny,
            lengths=lengths,
            repeats=args.repeats,
            device=device,
            dtype=parse_dtype(args.dtype),
            started=started,
            budget_s=args.budget_s,
            out=report["pairs"][name],
            save=save,
            trace_to=args.trace if index == 0 else None,
        )
        save()
    print(
        json.dumps(
            {
                name: [
                    {k: row.get(k) for k in ("tokens", "own_median_s", "escalation_median_s", "speedup", "skipped")}
                    for row in pair.get("lengths", [])
                ]
                for name, pair in report["pairs"].items()
            },
            indent=1,
        )
    )
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
