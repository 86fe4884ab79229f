"""The GPU path at Qwen3-14B -> Qwen3-32B shapes, on one device, with random weights (issue 13).

    python benchmarks/gpu_scale.py --out docs/results/gpu_scale.json          # a GPU with >= 120 GiB
    python benchmarks/gpu_scale.py --cpu-scaled --out /tmp/gpu_scale_cpu.json  # the same, configs scaled down

On a device where kvhub is not installed (nothing can be fetched there), run it from a checkout with
``PYTHONPATH=.`` after ``ln -s ../registry kvhub/_registry`` (the package data an install provides).

Both models are built from the configs kvhub ships (registry/configs: the real Qwen3-14B and -32B, ~92 GB
of random bf16 weights together; no download), or, with --cpu-scaled, from the same configs scaled
down (:data:`SCALED`), and the run measures, in this order:

1. capture: both models' forward passes + K/V capture of one batch (kvhub.fitting.fit.capture_pair), tokens/s,
   and the device's peak memory during it against ``kvhub plan``'s device peak for one rank;
2. transfer vs re-prefill: per context length, mapper.transfer of the source cache vs the target
   body re-prefilling the context, interleaved, timed with CUDA events (perf_counter on a CPU); the
   mapper has random weights with the plan's k sources per target layer (what is timed is the same);
3. statistics: rows/s of KVStats.update on the device for --stats-layers source and target layers
   (the full layout's Gram does not fit next to the models), with the measured FLOP rate and the
   rows/s (and calibration tokens/s, at the stride) it implies for the full layout;
4. solve: the models are freed, then one rank's share (the full source Gram, --solve-layers target
   layers, statistics from random rows on the device) is solved with k and lambda auto, against the
   plan's estimate.

Everything lands in one JSON file.  Targets (issue 13): transfer >= 20x faster than re-prefill at 4k
tokens; the whole run under 8 minutes on an H200.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

SRC, DST = "Qwen/Qwen3-14B", "Qwen/Qwen3-32B"
SCALED = {  # per model: the real config with these fields replaced (ratios of depth and width roughly kept)
    SRC: {
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 192,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    DST: {
        "num_hidden_layers": 6,
        "hidden_size": 64,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 288,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}


def configs(scaled: bool) -> dict[str, dict]:
    from kvhub.fitting.plan import load_config

    out = {}
    for model_id in (SRC, DST):
        config = dict(load_config(model_id)[0])
        out[model_id] = {**config, **SCALED[model_id]} if scaled else config
    return out


def build_model(config: dict, *, device: torch.device, dtype: torch.dtype, seed: int):
    """A randomly initialised causal LM, created directly on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    fields = {k: v for k, v in config.items() if k not in ("architectures", "_name_or_path", "torch_dtype")}
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields), dtype=dtype)
    return model.eval()


class Timer:
    """Seconds of ``fn()``: CUDA events on a GPU, perf_counter on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if not self.cuda:
            started = time.perf_counter()
            fn()
            return time.perf_counter() - started
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000


def random_mapper(source, target, *, k: int, seed: int, device: torch.device):
    """A Mapper of the fitted kind (k sources per target layer, fp32 maps) with random weights."""
    from kvhub.dtypes import dtype_name
    from kvhub.core.fingerprint import model_fingerprint
    from kvhub.fitting.fit import build_mapper, layout_for
    from kvhub.fitting.options import FitOptions
    from kvhub.core.solve import LayerSolution, LinearMap, Solution
    from kvhub.core.stats import KVStats, Moments

    layout = layout_for(source.config, target.config)
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for m in range(layout.dst_layers):
        sources = sorted(torch.randperm(layout.src_layers, generator=gen)[:k].tolist())
        maps = [
            LinearMap(
                [
                    (
                        torch.randn(k * layout.src_width, layout.dst_width, generator=gen)
                        / math.sqrt(k * layout.src_width),
                        None,
                    )
                ],
                torch.zeros(layout.dst_width),
                0.01,
            )
            for _ in "kv"
        ]
        layers.append(LayerSolution(m, sources, *maps))
    probe = torch.zeros(layout.src_layers, layout.dst_layers)
    solution = Solution(layers, probe, probe, k, 0.01, "fixed")
    counts = KVStats.__new__(KVStats)  # build_mapper reads the row counts and the target means only
    counts.layout = layout
    counts.k, counts.v = (
        Moments(0, layout.dst_layers * layout.dst_width),
        Moments(0, layout.dst_layers * layout.dst_width),
    )
    fingerprints = []
    for model, name in ((source, SRC), (target, DST)):
        fp = model_fingerprint(model.config, model_id=name)
        fp["dtype"] = dtype_name(model.dtype)
        fingerprints.append(fp)
    mapper = build_mapper(solution, *fingerprints, {}, counts, counts, FitOptions())
    return mapper.to(device)


def measure_capture(source, target, *, batch: int, seq_len: int, stride: int, device, plan) -> dict:
    from kvhub.fitting.fit import capture_pair
    from kvhub.fitting.options import FitOptions
    from kvhub.core.rope import Rotary

    ids = torch.randint(0, target.config.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(1))
    options = FitOptions(stride=stride, batch_size=batch)
    rotaries = (Rotary.from_model(source), Rotary.from_model(target))
    capture_pair(source, target, ids[:1, :16], rotaries, options)  # warm-up
    timer = Timer(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    seconds = timer(lambda: capture_pair(source, target, ids, rotaries, options))
    out = {
        "batch": batch,
        "seq_len": seq_len,
        "stride": stride,
        "seconds": seconds,
        "tokens_per_s": batch * seq_len / seconds,
        "plan_device_peak_bytes": plan.memory["weights"] + plan.memory["activations"],
    }
    if device.type == "cuda":
        out["peak_bytes"] = torch.cuda.max_memory_allocated(device)
        out["peak_vs_plan"] = out["peak_bytes"] / out["plan_device_peak_bytes"]
    return out


def measure_transfer(mapper, source, target, *, lengths, repeats: int, device) -> list[dict]:
    from kvhub.core.capture import run_model

    timer, rows = Timer(device), []
    for length in lengths:
        ids = torch.randint(0, target.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
        ids = ids.to(device)
        source_cache = run_model(source, ids[:, :-1])
        ops = {
            "transfer": lambda cache=source_cache: mapper.transfer(cache),
            "prefill": lambda ids=ids: run_model(target, ids[:, :-1]),
        }
        for fn in ops.values():
            fn()  # warm-up
        samples = {name: [] for name in ops}
        for _ in range(repeats):
            for name, fn in ops.items():  # interleaved, so drift hits both alike
                samples[name].append(timer(fn))
        row = {"tokens": length, **{f"{n}_median_s": statistics.median(v) for n, v in samples.items()}}
        row["speedup"] = row["prefill_median_s"] / row["transfer_median_s"]
        rows.append(row)
        del source_cache
    return rows


def measure_statistics(
    source_shape, target_shape, *, layers: int, rows: int, batches: int, stride: int, device
) -> dict:
    from kvhub.core.stats import KVStats, Layout

    src_layers, dst_layers = min(layers, source_shape.layers), min(layers, target_shape.layers)
    layout = Layout(src_layers, source_shape.kv_width, dst_layers, target_shape.kv_width)
    p, q = src_layers * layout.src_width, dst_layers * layout.dst_width
    stats = KVStats(layout, device=device)
    gen = torch.Generator(device=device).manual_seed(2)
    x = [torch.randn(rows, layout.src_width, generator=gen, device=device) for _ in range(src_layers)]
    y = [torch.randn(rows, layout.dst_width, generator=gen, device=device) for _ in range(dst_layers)]
    stats.update(x, x, y, y)  # warm-up
    seconds = Timer(device)(lambda: [stats.update(x, x, y, y) for _ in range(batches)])
    flops = 4 * rows * batches * (p * p + p * q)  # K and V
    full_p = source_shape.layers * source_shape.kv_width
    full_q = target_shape.layers * target_shape.kv_width
    rate = flops / seconds
    return {
        "layout": [src_layers, layout.src_width, dst_layers, layout.dst_width],
        "rows": rows * batches,
        "seconds": seconds,
        "rows_per_s": rows * batches / seconds,
        "flop_per_s": rate,
        "full_layout_rows_per_s": rate / (4 * (full_p * full_p + full_p * full_q)),
        "full_layout_tokens_per_s": stride * rate / (4 * (full_p * full_p + full_p * full_q)),
    }


def measure_solve(source_shape, target_shape, *, layers: int, rows: int, device, plan_seconds: float) -> dict:
    from kvhub.core.solve import solve
    from kvhub.core.stats import KVStats, Layout

    layout = Layout(source_shape.layers, source_shape.kv_width, layers, target_shape.kv_width)
    gen = torch.Generator(device=device).manual_seed(3)
    mix = torch.randn(layout.src_width, layout.dst_width, generator=gen, device=device) / math.sqrt(layout.src_width)
    splits = []
    for count in (rows, max(1, rows // 4)):
        stats = KVStats(layout, device=device)
        for start in range(0, count, 4096):
            n = min(4096, count - start)
            x = [torch.randn(n, layout.src_width, generator=gen, device=device) for _ in range(layout.src_layers)]
            y = [
                x[(m * 7) % layout.src_layers] @ mix
                + 0.1 * torch.randn(n, layout.dst_width, generator=gen, device=device)
                for m in range(layers)
            ]
            stats.update(x, x, y, y)
        splits.append(stats)
    seconds = Timer(device)(lambda: solve(*splits))
    return {
        "layout": [layout.src_layers, layout.src_width, layers, layout.dst_width],
        "train_rows": rows,
        "seconds": seconds,
        "plan_seconds": plan_seconds,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-scaled", action="store_true", help="scaled-down configs on the CPU")
    parser.add_argument("--device", default=None, help="default: cuda, or cpu with --cpu-scaled")
    parser.add_argument("--lengths", default=None, help="context lengths [1024,4096,16384,32768; scaled: 64,256]")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4, help="capture batch (sequences)")
    parser.add_argument("--seq-len", type=int, default=None, help="capture sequence length [2048; scaled: 128]")
    parser.add_argument("--stride", type=int, default=4)
    parser.add_argument("--stats-layers", type=int, default=8, help="source and target layers of the statistics timing")
    parser.add_argument(
        "--solve-layers", type=int, default=8, help="target layers of the solved share [8: 1 rank of 8]"
    )
    parser.add_argument(
        "--solve-rows", type=int, default=None, help="train rows of the solved share [32768; scaled 512]"
    )
    parser.add_argument("--ranks", type=int, default=8, help="ranks of the planned job whose share is solved")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    from kvhub.fitting.plan import ModelShape, device_profile, plan_fit, workload_for

    started = time.perf_counter()
    device = torch.device(args.device or ("cpu" if args.cpu_scaled else "cuda"))
    scaled = args.cpu_scaled
    lengths = [int(v) for v in (args.lengths or ("64,256" if scaled else "1024,4096,16384,32768")).split(",")]
    seq_len = args.seq_len or (128 if scaled else 2048)
    cfgs = configs(scaled)
    shapes = [ModelShape.from_config(cfgs[m], model_id=m) for m in (SRC, DST)]
    profile = device_profile("cuda" if device.type == "cuda" else "cpu")
    dtype = torch.bfloat16
    capture_plan = plan_fit(
        *shapes,
        workload_for(samples=args.batch, seq_len=seq_len, stride=args.stride, batch_size=args.batch),
        profile,
        ranks=1,
    )
    job_plan = plan_fit(
        *shapes,
        workload_for(samples=256, seq_len=seq_len, stride=args.stride, batch_size=args.batch),
        profile,
        ranks=args.ranks,
    )
    report = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({torch.get_num_threads()} threads)",
        "scaled": scaled,
        "configs": {m: {k: cfgs[m][k] for k in SCALED[m]} for m in (SRC, DST)},
        "torch": torch.__version__,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every stage: a run stopped at its time limit keeps what it measured
        report["wall_s"] = time.perf_counter() - started
        args.out.write_text(json.dumps(report, indent=2) + "\n")

    source = build_model(cfgs[SRC], device=device, dtype=dtype, seed=0)
    target = build_model(cfgs[DST], device=device, dtype=dtype, seed=1)
    report["build_s"] = time.perf_counter() - started
    with torch.no_grad():
        report["capture"] = measure_capture(
            source, target, batch=args.batch, seq_len=seq_len, stride=args.stride, device=device, plan=capture_plan
        )
        save()
        mapper = random_mapper(source, target, k=4, seed=0, device=device)
        report["transfer"] = measure_transfer(
            mapper, source, target, lengths=lengths, repeats=args.repeats, device=device
        )
        save()
    del source, target, mapper
    if device.type == "cuda":
        torch.cuda.empty_cache()
    report["statistics"] = measure_statistics(
        *shapes,
        layers=args.stats_layers,
        rows=args.batch * seq_len // args.stride,
        batches=3,
        stride=args.stride,
        device=device,
    )
    save()
    solve_layers = min(args.solve_layers, shapes[1].layers)
    share = plan_fit(
        *shapes,
        workload_for(samples=256, seq_len=seq_len, stride=args.stride),
        profile,
        ranks=math.ceil(shapes[1].layers / solve_layers),
    )
    report["solve"] = measure_solve(
        *shapes,
        layers=solve_layers,
        rows=args.solve_rows or (512 if scaled else 32768),
        device=device,
        plan_seconds=share.seconds["solve"],
    )
    report["plan"] = {
        "ranks": args.ranks,
        "memory": job_plan.memory,
        "seconds": job_plan.seconds,
        "exchange_bytes": job_plan.exchange_bytes,
        "advice": job_plan.advice,
    }
    save()
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
