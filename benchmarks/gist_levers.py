"""The gist levers (issue 24): which change to the handoff brings the whole context back, each with its control.

    python benchmarks/gist_levers.py --mapper Qwen2.5-Coder-0.5B-Instruct:Qwen2.5-Coder-1.5B-Instruct:legal-docs@v1 \
        --kinds chat,document --context-tokens 1024 --n 4 --out docs/results/gist_levers_1k.json

Scores what ``kvhub eval --task gist-chat|gist-document`` scores (kvhub.eval.gist: the target's own
greedy answer, teacher-forced, under each cache; gap closed = (floor - variant) / (floor - own)), for
levers that need no refit, on the real mapper and on its no-information control with the same lever:

- the recompute spec: none, prefix + suffix only, the default handoff, other selectors, a larger prefix;
- ``exact_layers=n``: the target's first n layers computed exactly over the whole context (DroidSpeak's
  observation that early layers matter most); costs n/L of a prefill;
- ``key_scale``: mapped keys multiplied by a (a softmax temperature over mapped positions, against the
  ridge map's shrinkage of keys toward their mean); "r2" = 1/sqrt(R^2_K) of each layer.
- ``deshrink``: the map's own bias/scale (norm calibration without a refit, :mod:`kvhub.core.deshrink`):
  mean + (prediction - mean) / sqrt(R^2) per layer, for K and V ("kv") or V only ("v"); ``kv^1``: a stronger
  one, mean + (prediction - mean) / R^2 (the same clamp at 2x), to see whether more spread helps further.
  Every other lever reads the maps as fitted ("off"), as they were measured before de-shrinking became the
  default.
- ``calibrate``: an in-context correction of the de-shrunk maps after the recompute, per (layer, head, dim),
  estimated from the recomputed tokens (exact there, mapped before them): "affine" matches their mean and
  spread, "shift" their mean, "affine-k" keys only; "oracle" takes the statistics from the target's own
  cache over every token instead, the most any per-dimension mean/spread correction could do.

A fitted mapper directory (``--mapper DIR``, e.g. a ``--weighting attention`` fit exported with --out)
is scored the same way, so refit levers compare in one table.  Own answers, own and floor NLLs are
cached per item under --cache-dir: a second mapper costs only its variants.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvhub.core.capture import cache_kwargs, run_model
from kvhub.core.control import control_mapper
from kvhub.eval.gist import ANSWER_TOKENS, FLOOR_TOKENS, answer_nll, gap_closed, gist_items
from kvhub.serving.recompute import cropped, first_layers_kv, recompute_positions, recompute_set
from kvhub.serving.spec import HANDOFF, Recompute


@dataclass(frozen=True)
class Lever:
    name: str
    spec: Recompute
    exact_layers: int = 0
    key_scale: float | str = 1.0
    deshrink: str = "off"  # "kv", "v" or "off" (kvhub.core.deshrink); "kv^1": scale 1/R^2 instead of 1/sqrt(R^2)
    calibrate: str = ""  # in-context calibration of the mapped K/V after the recompute (context_calibrate)

    def cost(self, tokens: int, recomputed: int, layers: int) -> float:
        """Fraction of a full prefill's layer-token work: n/L exact layers + the rest over |R| tokens."""
        return self.exact_layers / layers + (1 - self.exact_layers / layers) * recomputed / tokens


LEVERS = [
    Lever("map only", Recompute()),
    Lever("map, exact 4 + 16", Recompute(4, 16)),
    Lever("handoff (4 + 16 + 8% source)", HANDOFF),
    Lever("handoff, select=target", replace(HANDOFF, select="target")),
    Lever("handoff, select=deviation", replace(HANDOFF, select="deviation")),
    Lever("handoff, exact_prefix=64", replace(HANDOFF, exact_prefix=64, exact_budget=0.02)),
    Lever("map, exact 4 + 16, exact_layers=2", Recompute(4, 16), exact_layers=2),
    Lever("4 + 16 + 3% source, exact_layers=2", replace(HANDOFF, exact_budget=0.03), exact_layers=2),
    Lever("handoff, key_scale=1.2", HANDOFF, key_scale=1.2),
    Lever("handoff, key_scale=1/sqrt(R2)", HANDOFF, key_scale="r2"),
    Lever("map, exact 4 + 16, key_scale=1/sqrt(R2)", Recompute(4, 16), key_scale="r2"),
    Lever("4 + 16 + 20% source (over the 10% budget)", replace(HANDOFF, exact_budget=0.2)),
    Lever("map only, de-shrunk K and V", Recompute(), deshrink="kv"),
    Lever("handoff, de-shrunk K and V", HANDOFF, deshrink="kv"),
    Lever("handoff, de-shrunk V", HANDOFF, deshrink="v"),
    Lever("handoff, de-shrunk K and V by 1/R2", HANDOFF, deshrink="kv^1"),
    Lever("handoff, de-shrunk, in-context affine K/V", HANDOFF, deshrink="kv", calibrate="affine"),
    Lever("handoff, de-shrunk, in-context shift K/V", HANDOFF, deshrink="kv", calibrate="shift"),
    Lever("handoff, de-shrunk, oracle affine K/V (own, all tokens)", HANDOFF, deshrink="kv", calibrate="oracle"),
    Lever("handoff, de-shrunk, in-context affine K", HANDOFF, deshrink="kv", calibrate="affine-k"),
]


def deshrunk_map(mapper, setting: str):
    """``mapper`` read with ``setting``; "kv^1" squares each layer's R^2 first, so that the 1/sqrt(R^2) of
    kvhub.core.deshrink becomes 1/R^2."""
    if setting != "kv^1":
        return mapper.deshrunk(setting)
    layers = [
        {**layer, "r2_k": max(layer["r2_k"], 0) ** 2, "r2_v": max(layer["r2_v"], 0) ** 2} for layer in mapper.layers
    ]
    return type(mapper)(mapper.tensors, {**mapper.metadata, "layers": layers}, dtype=mapper.dtype, deshrink="kv")


def key_scales(mapper, lever: Lever) -> dict[int, float]:
    if lever.key_scale == "r2":
        return {layer["target"]: 1 / math.sqrt(max(layer["r2_k"], 0.25)) for layer in mapper.layers}
    return {layer["target"]: float(lever.key_scale) for layer in mapper.layers}


@torch.no_grad()
def lever_cache(
    lever: Lever, which, *, source, target, tokenizer, context, source_cache, exact_layers_kv, scales, own=None
):
    """The handoff cache of ``context`` under ``lever`` with mapper ``which``; (cache, recomputed token count)."""
    tokens = context.shape[1]
    spec = lever.spec.capped(tokens)
    cache = which.transfer(cropped(source_cache, tokens), dtype=target.dtype)
    for index, layer in enumerate(cache.layers):
        if index < lever.exact_layers:
            layer.keys, layer.values = (t.clone() for t in exact_layers_kv[index])
        elif scales.get(index, 1.0) != 1.0:
            layer.keys = layer.keys * scales[index]
    positions = recompute_set(
        spec,
        context=context,
        mapped_cache=cache,
        source_model=source,
        target_model=target,
        source_cache=source_cache,
        tokenizer=tokenizer,
    )
    mapped = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers] if lever.calibrate else None
    recompute_positions(target, cache, context, positions)
    if lever.calibrate:
        context_calibrate(
            cache,
            mapped,
            positions,
            lever.calibrate,
            target=target,
            prefix=spec.exact_prefix,
            suffix=spec.exact_suffix,
            own=own,
        )
    return cache, positions.numel()


@torch.no_grad()
def context_calibrate(cache, mapped, positions, how: str, *, target, prefix: int, suffix: int, own=None):
    """Per (head, dim) affine correction of the mapped K/V at the positions not recomputed, estimated from
    the recomputed ones (exact there, mapped before): x' = mean_e + (x - mean_m) * std_e / std_m (ratio
    clamped to [0.5, 2]); "shift": x' = x + mean_e - mean_m.  Keys are corrected with RoPE stripped.
    "oracle": the statistics of the target's own cache over every token (an upper bound)."""
    from kvhub.core.rope import Rotary, apply_rope, strip_rope

    tokens = cache.layers[0].keys.shape[2]
    sample = positions[(positions >= prefix) & (positions < tokens - suffix)]
    keep = torch.ones(tokens, dtype=torch.bool)
    keep[positions] = False
    rotary = Rotary.from_model(target)
    cos, sin = rotary.cos_sin(torch.arange(tokens).unsqueeze(0))
    for index, layer in enumerate(cache.layers):
        for kind in ("keys", "values"):
            if how == "affine-k" and kind == "values":
                continue
            before = mapped[index][0 if kind == "keys" else 1].float()
            if how == "oracle":
                exact = getattr(own.layers[index], kind).float()
                sample_idx = torch.arange(prefix, tokens - suffix)
            else:
                exact = getattr(layer, kind).float()
                sample_idx = sample
            now = getattr(layer, kind).float()
            if kind == "keys":
                before, exact, now = (strip_rope(x, cos, sin) for x in (before, exact, now))
            e, m = exact[:, :, sample_idx], before[:, :, sample_idx]
            mean_e, mean_m = e.mean(2, keepdim=True), m.mean(2, keepdim=True)
            if how == "shift":
                fixed = now + (mean_e - mean_m)
            else:
                ratio = (e.std(2, keepdim=True) / m.std(2, keepdim=True).clamp_min(1e-6)).clamp(0.5, 2.0)
                fixed = mean_e + (now - mean_m) * ratio
            out = torch.where(keep[None, None, :, None], fixed, now)
            if kind == "keys":
                out = apply_rope(out, cos, sin)
            setattr(layer, kind, out.to(getattr(layer, kind).dtype))


@torch.no_grad()
def greedy_answer(target, cache, last_token: int, steps: int) -> list[int]:
    """Greedy continuation of ``cache`` + last_token (eos suppressed, as gist.own_answer's min_new_tokens)."""
    eos = target.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    answer, token = [], last_token
    for _ in range(steps):
        past = cache.get_seq_length()
        logits = (
            target(
                input_ids=torch.tensor([[token]]),
                position_ids=torch.tensor([[past]]),
                use_cache=True,
                **cache_kwargs(target, cache),
            )
            .logits[0, -1]
            .float()
        )
        logits[eos] = -math.inf
        token = int(logits.argmax())
        answer.append(token)
    return answer


def item_reference(item, *, target, source, cache_dir: Path):
    """(answer, nll own, nll floor, source cache) of one item; the first three cached on disk."""
    prompt = item.prompt_ids
    context = torch.tensor([prompt[:-1]])
    path = cache_dir / f"{item.id}.json"
    source_cache = run_model(source, context)
    if path.exists():
        ref = json.loads(path.read_text())
        if ref["prompt"] == prompt:
            return ref["answer"], ref["own"], ref["floor"], source_cache
    own = run_model(target, context)
    answer = greedy_answer(target, copy.deepcopy(own), prompt[-1], ANSWER_TOKENS)
    tail = [prompt[-1]] + answer
    nll_own = answer_nll(target, own, tail, len(answer))
    nll_floor = answer_nll(target, run_model(target, torch.tensor([prompt[-FLOOR_TOKENS:-1]])), tail, len(answer))
    path.write_text(json.dumps({"prompt": prompt, "answer": answer, "own": nll_own, "floor": nll_floor}))
    return answer, nll_own, nll_floor, source_cache


def summarize(rows: list[dict]) -> dict:
    mean = {c: sum(r[c] for r in rows) / len(rows) for c in ("own", "floor", "mapped", "control")}
    return {
        "n": len(rows),
        **{f"nll_{c}": v for c, v in mean.items()},
        "gap_closed_mapped": gap_closed(mean, "mapped"),
        "gap_closed_control": gap_closed(mean, "control"),
        "per_item_mapped": [gap_closed(r, "mapped") for r in rows],
        "cost": sum(r["cost"] for r in rows) / len(rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mapper", required=True, help="store reference or exported mapper directory")
    parser.add_argument("--kinds", default="chat,document")
    parser.add_argument("--context-tokens", type=int, default=1024)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--only", help="comma-separated lever indices (default: all)")
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache/kvhub/bench/gist"))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from kvhub.api import Mapper
    from kvhub.models.loading import load_model

    torch.set_grad_enabled(False)
    # a directory, a store ref or a Hub repo, read as fitted: each lever picks its own deshrink
    mapper = Mapper.from_pretrained(args.mapper, dtype=torch.float32, deshrink="off")
    control = control_mapper(mapper)
    source, tokenizer, _ = load_model(mapper.source["model_id"], dtype="float32")
    target, _, _ = load_model(mapper.target["model_id"], dtype="float32")
    layers = target.config.num_hidden_layers
    levers = [LEVERS[int(i)] for i in args.only.split(",")] if args.only else LEVERS
    maps = {lever.deshrink: deshrunk_map(mapper, lever.deshrink) for lever in levers}
    cache_dir = Path(args.cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    out_path = Path(args.out)
    report = json.loads(out_path.read_text()) if out_path.exists() else {}
    report.setdefault("runs", {})
    key = f"{args.mapper} @ {args.context_tokens}"
    run = report["runs"].setdefault(
        key, {"mapper": args.mapper, "context_tokens": args.context_tokens, "command": " ".join(sys.argv), "kinds": {}}
    )
    for kind in args.kinds.split(","):
        items = gist_items(kind, tokenizer, context_tokens=args.context_tokens, n=args.n, seed=0)
        rows = {lever.name: [] for lever in levers}
        for item in items:
            started = time.time()
            answer, nll_own, nll_floor, source_cache = item_reference(
                item, target=target, source=source, cache_dir=cache_dir
            )
            context = torch.tensor([item.prompt_ids[:-1]])
            tail = [item.prompt_ids[-1]] + answer
            most = max(lever.exact_layers for lever in levers)
            exact_kv = first_layers_kv(target, context, most) if most else []
            own_cache = run_model(target, context) if any(lv.calibrate == "oracle" for lv in levers) else None
            for lever in levers:
                row = {"own": nll_own, "floor": nll_floor}
                real = maps[lever.deshrink]
                for condition, which in (("mapped", real), ("control", control)):
                    cache, recomputed = lever_cache(
                        lever,
                        which,
                        source=source,
                        target=target,
                        tokenizer=tokenizer,
                        context=context,
                        source_cache=source_cache,
                        exact_layers_kv=exact_kv,
                        scales=key_scales(mapper, lever),
                        own=own_cache,
                    )
                    row[condition] = answer_nll(target, cache, tail, len(answer))
                row["cost"] = lever.cost(context.shape[1], recomputed, layers)
                rows[lever.name].append(row)
            print(f"{kind} {item.id}: {time.time() - started:.0f}s", file=sys.stderr, flush=True)
        run["kinds"].setdefault(kind, {}).update({name: summarize(r) for name, r in rows.items()})
        out_path.write_text(json.dumps(report, indent=1))
        for name, summary in run["kinds"][kind].items():
            print(
                f"{kind:9s} {name:44s} gap closed {summary['gap_closed_mapped']:+.2f} "
                f"(control {summary['gap_closed_control']:+.2f}) cost {summary['cost']:.1%}"
            )


if __name__ == "__main__":
    main()
