"""How much dispatch work one escalation costs on a CPU, phase by phase, beside the target's own prefill (issue 45).

    python benchmarks/escalation_ops.py --out docs/results/escalation_ops.json     # 2 CPU cores: ~3 minutes
    python benchmarks/escalation_ops.py --lengths 64 --repeats 3 --out /tmp/ops.json   # what the test runs

On a GPU every aten operator is host time or a kernel launch, and at 1k tokens an escalation is host-bound
(docs/benchmarks.md, the GPU table).  This script counts the operators with a ``TorchDispatchMode``, which
needs no GPU, for a pair with the depth of the real one: a 24-layer source and a 28-layer target
(Qwen2.5-0.5B and -7B depths), both narrow (hidden 64, random weights), and a mapper fitted between them on
random ids (the count does not depend on what the weights are).  Side by side in one run, at each length n:

- ``own``: the target's prefill of the n-token prompt to its first logits (``target(ids, logits_to_keep=1)``);
- ``source_prefill``: the source's prefill of the context (n-1 tokens): what a cascade already paid, so
  excluded from every escalation count below;
- ``before``: kvhub's escalation before issue 45, rebuilt here from the same library parts: ``select``
  (a second source pass of the last Q tokens under eager attention with hooks, then the span choice),
  ``map`` (``Mapper.transfer`` with the per-layer loop), ``recompute`` (the recomputed tokens appended
  after the cache under an (R, T+R) mask, then copied back) and ``first_token`` (a separate forward of the
  last prompt token);
- ``after``: :func:`kvhub.serving.handoff.escalate` from a given source cache, phase by phase: ``scoring``
  (what :class:`~kvhub.core.last_queries.LastQueryAttention` adds to the source's prefill),
  ``select`` (the span choice from those scores), ``map`` (the stacked map) and ``recompute`` (one pass
  that also yields the first logits); and ``escalate`` counted whole (scoring included).  The stacked maps
  are built by the first transfer of a process (``map_first_use``), before the counts;
- ``handoff``: ``kvhub.handoff(..., max_new_tokens=1)`` less ``source_prefill``, before (the old parts and
  generate's first forward) and after.

Each count is beside ``own``, as a ratio.  ``host_ms``: the median wall time of ``before`` and ``after`` (from a
given cache, to the first logits) over ``--repeats`` alternating runs at ``--host-length`` tokens, where the
narrow models' arithmetic is negligible and what is left is dispatch.  Nothing in kvhub imports this
script; tests/serving/test_escalation_ops_script.py runs it small so it cannot rot.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=512)
DEPTHS = (24, 28)  # Qwen2.5-0.5B -> Qwen2.5-7B


class OpCounter(TorchDispatchMode):
    """Counts every aten operator dispatched while entered (``total``; ``by_name`` per operator)."""

    def __init__(self):
        super().__init__()
        self.total = 0
        self.by_name: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.total += 1
        self.by_name[func.__name__] += 1
        return func(*args, **(kwargs or {}))


def count(fn, *, counting: bool = True):
    """(operators ``fn()`` dispatches, its result); (0, result) without ``counting`` (the timed runs)."""
    if not counting:
        return 0, fn()
    with OpCounter() as counter:
        result = fn()
    return counter.total, result


@contextmanager
def loop_map():
    """Mapper.transfer's per-layer loop (the map before issue 45) while entered."""
    from kvhub.core import batched_map

    saved, batched_map._ENABLED = batched_map._ENABLED, False
    try:
        yield
    finally:
        batched_map._ENABLED = saved


def build(seed: int = 0):
    """(source, target, mapper): narrow qwen2 models of DEPTHS layers and a ridge mapper fitted between them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvhub.fitting.fit import fit
    from kvhub.fitting.options import FitOptions

    models = []
    for depth in DEPTHS:
        torch.manual_seed(seed + depth)
        config = AutoConfig.for_model("qwen2", num_hidden_layers=depth, max_position_embeddings=8192, **SHAPE)
        config._attn_implementation = "sdpa"
        models.append(AutoModelForCausalLM.from_config(config).eval())
    ids = torch.randint(0, SHAPE["vocab_size"], (10, 64), generator=torch.Generator().manual_seed(seed))
    mapper = fit(*models, ids[:8], ids[8:], source_id="bench/src24", target_id="bench/dst28",
                 options=FitOptions(stride=1, batch_size=8))  # fmt: skip
    return models[0], models[1], mapper


def appended_pass(target, cache, context, positions):
    """The recompute pass before issue 45: the |R| tokens appended after the T cached ones under an (R, T + R)
    mask (mapped j < t not in R, recomputed t' <= t), then written back over the mapped K/V."""
    from kvhub.core.capture import cache_kwargs

    tokens, chosen, device = context.shape[1], positions.numel(), context.device
    positions = positions.to(device)
    in_set = torch.zeros(tokens, dtype=torch.bool, device=device)
    in_set[positions] = True
    to_cache = (torch.arange(tokens, device=device)[None, :] < positions[:, None]) & ~in_set[None, :]
    allowed = torch.cat([to_cache, torch.ones(chosen, chosen, dtype=torch.bool, device=device).tril()], dim=1)
    mask = torch.zeros(allowed.shape, dtype=target.dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(target.dtype).min)
    target.base_model(input_ids=context[:, positions], position_ids=positions[None], attention_mask=mask[None, None],
                      use_cache=True, **cache_kwargs(target.base_model, cache))  # fmt: skip
    for layer in cache.layers:
        layer.keys = layer.keys[:, :, :tokens].index_copy(2, positions, layer.keys[:, :, tokens:])
        layer.values = layer.values[:, :, :tokens].index_copy(2, positions, layer.values[:, :, tokens:])


def before(mapper, source, target, ids, source_cache, spec, phases: dict | None = None):
    """The escalation before issue 45 to the first logits; ``phases`` (if given) receives each phase's count."""
    from kvhub.core.capture import cache_kwargs
    from kvhub.serving.recompute import recompute_set

    context, tokens = ids[:, :-1], ids.shape[1] - 1
    steps, on = (phases if phases is not None else {}), phases is not None
    with loop_map():
        steps["map"], cache = count(lambda: mapper.transfer(source_cache, dtype=target.dtype), counting=on)
    common = dict(context=context, mapped_cache=cache, source_model=source, target_model=target)
    steps["select"], positions = count(lambda: recompute_set(spec, source_cache=source_cache, **common), counting=on)
    steps["recompute"], _ = count(lambda: appended_pass(target, cache, context, positions), counting=on)
    position = torch.full((1, 1), tokens, device=ids.device)
    steps["first_token"], out = count(
        lambda: target(input_ids=ids[:, -1:], position_ids=position, logits_to_keep=1, **cache_kwargs(target, cache)),
        counting=on,
    )
    return out.logits[:, -1], cache


def after(mapper, source, target, ids, source_cache, attention, spec, phases: dict | None = None):
    """:func:`kvhub.serving.handoff.escalate`'s steps from a given cache and prefill attention, counted apart."""
    from kvhub.serving.recompute import recompute_positions, recompute_set

    context = ids[:, :-1]
    steps, on = (phases if phases is not None else {}), phases is not None
    steps["map"], cache = count(lambda: mapper.transfer(source_cache, dtype=target.dtype), counting=on)
    common = dict(context=context, mapped_cache=cache, source_model=source, target_model=target)
    steps["select"], positions = count(
        lambda: recompute_set(spec, source_cache=source_cache, source_attention=attention, **common), counting=on
    )
    steps["recompute"], (logits, _) = count(
        lambda: recompute_positions(target, cache, context, positions, last=ids[:, -1:]), counting=on
    )
    return logits, cache


def old_handoff(mapper, source, target, ids, spec):
    """kvhub.handoff(max_new_tokens=1) before issue 45: source prefill, the old parts, generate's first forward."""
    from kvhub.core.capture import cache_kwargs, run_model
    from kvhub.serving.recompute import recompute_set

    context = ids[:, :-1]
    source_cache = run_model(source, context)
    with loop_map():
        cache = mapper.transfer(source_cache, dtype=target.dtype)
    common = dict(context=context, mapped_cache=cache, source_model=source, target_model=target)
    appended_pass(target, cache, context, recompute_set(spec, source_cache=source_cache, **common))
    return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                           **cache_kwargs(target, cache))  # fmt: skip


def measure(mapper, source, target, length: int) -> dict:
    from kvhub.core.capture import run_model
    from kvhub.core.last_queries import LastQueryAttention
    from kvhub.serving.handoff import escalate, handoff
    from kvhub.serving.recompute import selection_queries
    from kvhub.serving.spec import HANDOFF

    ids = torch.randint(0, SHAPE["vocab_size"], (1, length), generator=torch.Generator().manual_seed(length))
    context = ids[:, :-1]
    spec = HANDOFF.capped(length - 1)
    own, _ = count(lambda: target(input_ids=ids, logits_to_keep=1))
    prefill, source_cache = count(lambda: run_model(source, context))
    first_use, _ = count(lambda: mapper.transfer(source_cache, dtype=target.dtype))  # builds the stacked maps

    def scored_prefill():
        with LastQueryAttention(source, queries=selection_queries(spec, length - 1)) as scored:
            run_model(source, context)
        return scored.attention[0]

    scored_ops, attention = count(scored_prefill)
    old_phases, new_phases = {}, {"scoring": scored_ops - prefill}
    old_logits, _ = before(mapper, source, target, ids, source_cache, spec, old_phases)
    new_logits, _ = after(mapper, source, target, ids, source_cache, attention, spec, new_phases)
    whole, done = count(
        lambda: escalate(
            mapper, source, target, ids, recompute=spec, source_cache=source_cache, source_attention=attention
        )
    )
    old_handoff_ops, old_out = count(lambda: old_handoff(mapper, source, target, ids, spec))
    new_handoff_ops, new_out = count(lambda: handoff(mapper, source, target, ids, max_new_tokens=1, do_sample=False))
    old_total, new_total = sum(old_phases.values()), sum(new_phases.values())
    return {
        "tokens": length,
        "recomputed": int(done.positions.numel()),
        "own": own,
        "source_prefill": prefill,
        "map_first_use": first_use,  # the first transfer of a process also stacks the maps (once per process)
        "before": {**old_phases, "total": old_total, "vs_own": round(old_total / own, 2)},
        "after": {
            **new_phases,
            "total": new_total,
            "vs_own": round(new_total / own, 2),
            "escalate": whole + new_phases["scoring"],
        },  # fmt: skip
        "handoff": {
            "before": old_handoff_ops - prefill,
            "after": new_handoff_ops - prefill,
            "before_vs_own": round((old_handoff_ops - prefill) / own, 2),
            "after_vs_own": round((new_handoff_ops - prefill) / own, 2),
        },
        "first_logits_max_abs_diff": float((old_logits - new_logits).abs().max()),
        "same_first_token": bool(torch.equal(old_out[:, -1], new_out[:, -1])),
    }


def host_time(mapper, source, target, length: int, repeats: int) -> dict:
    """Median ms of ``before`` and ``after`` from a given cache to the first logits (alternating runs)."""
    from kvhub.core.capture import run_model
    from kvhub.core.last_queries import LastQueryAttention
    from kvhub.serving.recompute import selection_queries
    from kvhub.serving.spec import HANDOFF

    ids = torch.randint(0, SHAPE["vocab_size"], (1, length), generator=torch.Generator().manual_seed(1))
    spec = HANDOFF.capped(length - 1)
    with LastQueryAttention(source, queries=selection_queries(spec, length - 1)) as scored:
        source_cache = run_model(source, ids[:, :-1])
    attention = scored.attention[0]
    runs = {
        "before": lambda: before(mapper, source, target, ids, source_cache, spec),
        "after": lambda: after(mapper, source, target, ids, source_cache, attention, spec),
    }
    samples: dict = {name: [] for name in runs}
    for fn in runs.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in runs.items():
            started = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - started) * 1000)
    medians = {name: round(statistics.median(values), 2) for name, values in samples.items()}
    return {"tokens": length, **medians, "after_vs_before": round(medians["after"] / medians["before"], 3)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="1024,4096", help="prompt lengths, comma-separated")
    parser.add_argument("--host-length", type=int, default=128, help="prompt length of the host-time runs")
    parser.add_argument("--repeats", type=int, default=20, help="alternating host-time runs of each path")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    with torch.no_grad():
        source, target, mapper = build()
        rows = [measure(mapper, source, target, int(n)) for n in args.lengths.split(",")]
        host = host_time(mapper, source, target, args.host_length, args.repeats)
    result = {
        "command": "python benchmarks/escalation_ops.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "pair": f"qwen2 {DEPTHS[0]} -> {DEPTHS[1]} layers, {SHAPE}, random weights, fitted ridge mapper "
        f"(k={mapper.metadata.get('k')})",  # fmt: skip
        "lengths": rows,
        "host": host,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for row in rows:
        print(f"n={row['tokens']}: own {row['own']} ops; before {row['before']['total']} ({row['before']['vs_own']}x), "
              f"after {row['after']['total']} ({row['after']['vs_own']}x); handoff {row['handoff']['before_vs_own']}x"
              f" -> {row['handoff']['after_vs_own']}x")  # fmt: skip
    print(f"host ms at {host['tokens']} tokens: before {host['before']}, after {host['after']}")
    return result


if __name__ == "__main__":
    main()
