"""capture -> statistics -> solve -> Mapper, with progress callbacks and resumable checkpoints.

One pass over the calibration sequences: each batch runs through the source and the target model,
both captures feed :class:`kvhub.core.stats.KVStats` (train and held-out splits separately), and the
solve (:mod:`kvhub.core.solve`) never touches the models again.  Statistics are checkpointed atomically
every ``checkpoint_every`` batches; a fit started again with the same checkpoint file and the same
job (models, tokens, stride) continues after the last checkpointed batch and ends with the same
statistics, hence the same mapper.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from kvhub import __version__
from kvhub.artifact import atomic_write_bytes, map_prefix, tensor_name
from kvhub.core.capture import capture
from kvhub.errors import ConfigError, IncompatibleError
from kvhub.models.fingerprint import kv_geometry, model_fingerprint
from kvhub.core.mapper import Mapper
from kvhub.core.rope import Rotary
from kvhub.core.solve import Solution, Structure, head_groups, solve
from kvhub.core.stats import KVStats, Layout

log = logging.getLogger(__name__)

from kvhub.progress import Progress  # noqa: E402  (label, completed tokens, total tokens)


@dataclass
class FitOptions:
    """Knobs of a fit.  stride: keep every s-th token (paper: 4); skip_first: drop the first tokens.
    head_local / rank: compressed maps (see :mod:`kvhub.core.solve`); they change only the solve."""

    k: int | str = "auto"
    lambda_: float | str = "auto"
    head_local: bool = False
    rank: int | None = None
    stride: int = 4
    skip_first: int = 0
    batch_size: int = 4
    weighting: str = "uniform"  # "attention": weigh rows by the target's attention (kvhub.core.capture)
    weight_cap: float = 10.0  # cap of the raw attention weight, against attention sinks
    checkpoint: Path | None = None
    checkpoint_every: int = 4
    timings: dict = field(default_factory=dict)


def check_same_tokenizer(source_fp: dict, target_fp: dict) -> None:
    """Refuse a pair whose tokenizers differ (a mapper needs token-aligned caches)."""
    src, dst = source_fp.get("tokenizer_hash"), target_fp.get("tokenizer_hash")
    if src is not None and dst is not None and src != dst:
        raise IncompatibleError(
            f"{source_fp['model_id']} and {target_fp['model_id']} use different tokenizers "
            f"(sha256 {src[:12]} vs {dst[:12]}); a KV mapper needs both models to read the same tokens. "
            "Pick a source and a target of the same family and tokenizer."
        )


def pair_fingerprints(source_model, target_model, *, source_id: str, target_id: str, source_tokenizer=None,
                      target_tokenizer=None) -> tuple[dict, dict]:
    """The fingerprints (with dtypes) of a (source, target) pair; refused when their tokenizers differ."""
    fingerprints = []
    for model, model_id, tokenizer in ((source_model, source_id, source_tokenizer),
                                       (target_model, target_id, target_tokenizer)):
        fingerprint = model_fingerprint(model.config, model_id=model_id, tokenizer=tokenizer)
        fingerprint["dtype"] = str(model.dtype).replace("torch.", "")
        fingerprints.append(fingerprint)
    check_same_tokenizer(*fingerprints)
    return fingerprints[0], fingerprints[1]


def structure_for(source_fp: dict, target_fp: dict, *, head_local: bool, rank: int | None) -> Structure:
    """Map structure of a fit: head groups = gcd of the KV head counts when head-local, else 1."""
    groups = head_groups(source_fp["num_kv_heads"], target_fp["num_kv_heads"]) if head_local else 1
    if head_local and groups == 1:
        log.warning("head-local maps: %s and %s KV heads share no common group; the map stays dense",
                    source_fp["num_kv_heads"], target_fp["num_kv_heads"])
    return Structure(groups=groups, rank=rank)


def layout_for(source_config, target_config) -> Layout:
    s_layers, s_heads, s_dim = kv_geometry(source_config)
    t_layers, t_heads, t_dim = kv_geometry(target_config)
    return Layout(s_layers, s_heads * s_dim, t_layers, t_heads * t_dim)


def fit(
    source_model,
    target_model,
    train_ids: torch.Tensor,
    heldout_ids: torch.Tensor | None,
    *,
    source_id: str,
    target_id: str,
    source_tokenizer=None,
    target_tokenizer=None,
    calibration: dict | None = None,
    options: FitOptions | None = None,
    progress: Progress | None = None,
) -> Mapper:
    """Fit a Mapper from ``source_model``'s cache to ``target_model``'s.

    train_ids (N, T) and heldout_ids (M, T): long token ids (no padding).  ``calibration`` is the
    calibration-set metadata stored in mapper.json.  Returns an unsaved Mapper (weights fp32).
    """
    options = options or FitOptions()
    source_fp, target_fp = pair_fingerprints(source_model, target_model, source_id=source_id, target_id=target_id,
                                             source_tokenizer=source_tokenizer, target_tokenizer=target_tokenizer)
    train, heldout = accumulate(
        source_model, target_model, train_ids, heldout_ids, options=options, progress=progress,
        job=_job_hash(source_fp, target_fp, train_ids, heldout_ids, options),
    )
    started = time.perf_counter()
    solution = solve(train, heldout, k=options.k, lambda_=options.lambda_, structure=structure_for(
        source_fp, target_fp, head_local=options.head_local, rank=options.rank))
    options.timings["solve_s"] = time.perf_counter() - started
    return build_mapper(solution, source_fp, target_fp, calibration or {}, train, heldout, options)


def accumulate(source_model, target_model, train_ids, heldout_ids, *, options: FitOptions,
               progress: Progress | None, job: str) -> tuple[KVStats, KVStats]:
    """One pass over both splits; returns (train, heldout) statistics.  Resumes from a checkpoint."""
    layout = layout_for(source_model.config, target_model.config)
    batches = fit_batches(train_ids, heldout_ids, options.batch_size)
    stats = {"train": KVStats(layout), "heldout": KVStats(layout)}
    done = _load_checkpoint(options.checkpoint, job, stats) if options.checkpoint else 0
    total = sum(int(b.numel()) for _, b in batches)
    completed = sum(int(b.numel()) for _, b in batches[:done])
    rotaries = (Rotary.from_model(source_model), Rotary.from_model(target_model))
    options.timings.setdefault("forward_s", 0.0), options.timings.setdefault("stats_s", 0.0)
    for index in range(done, len(batches)):
        name, ids = batches[index]
        if progress:
            progress(f"capture: {name} batch {index + 1}/{len(batches)}", completed, total)
        _accumulate_batch(source_model, target_model, ids, stats[name], rotaries, options)
        completed += int(ids.numel())
        if options.checkpoint and ((index + 1) % options.checkpoint_every == 0):
            _save_checkpoint(options.checkpoint, job, stats, index + 1)
    if progress:
        progress("capture: done", completed, total)
    return stats["train"], stats["heldout"]


def _accumulate_batch(source_model, target_model, ids, stats: KVStats, rotaries, options: FitOptions) -> None:
    src, dst = capture_pair(source_model, target_model, ids, rotaries, options)
    started = time.perf_counter()
    device = stats.k.cxx.device
    weights = dst.weights.to(device) if dst.weights is not None else None
    stats.update([b.to(device) for b in src.keys], [b.to(device) for b in src.values],
                 [b.to(device) for b in dst.keys], [b.to(device) for b in dst.values], weights=weights)
    options.timings["stats_s"] += time.perf_counter() - started


def fit_batches(train_ids, heldout_ids, batch_size: int) -> list[tuple[str, torch.Tensor]]:
    """The fit's batches, in the order their statistics are merged: (split name, (B, T) ids), train first."""
    splits = [("train", train_ids), ("heldout", heldout_ids if heldout_ids is not None else train_ids[:0])]
    return [(name, ids[i : i + batch_size]) for name, ids in splits for i in range(0, ids.shape[0], batch_size)]


def capture_pair(source_model, target_model, ids, rotaries, options: FitOptions):
    """Both models' captures of one batch of ids: (source CapturedKV, target CapturedKV with row weights
    when weighting by attention).  Adds the forward time and tokens to ``options.timings``."""
    started = time.perf_counter()
    kwargs = {"stride": options.stride, "skip_first": options.skip_first}
    src = capture(source_model, ids, rotary=rotaries[0], **kwargs)
    dst = capture(target_model, ids, rotary=rotaries[1], attention_weights=_attention_weighted(options),
                  weight_cap=options.weight_cap, **kwargs)
    timings = options.timings
    timings["forward_s"] = timings.get("forward_s", 0.0) + time.perf_counter() - started
    timings["tokens"] = timings.get("tokens", 0) + int(ids.numel())
    return src, dst


def _attention_weighted(options: FitOptions) -> bool:
    if options.weighting not in ("uniform", "attention"):
        raise ConfigError(f"weighting must be 'uniform' or 'attention', got {options.weighting!r}")
    return options.weighting == "attention"


# ---- checkpoints --------------------------------------------------------------------------------
def _job_hash(source_fp, target_fp, train_ids, heldout_ids, options: FitOptions) -> str:
    digest = hashlib.sha256()
    for part in (source_fp["config_hash"], target_fp["config_hash"], options.stride, options.skip_first,
                 options.batch_size):
        digest.update(str(part).encode())
    if options.weighting != "uniform":  # uniform fits keep the hash of checkpoints written before weighting
        digest.update(f"weighting={options.weighting},cap={options.weight_cap!r}".encode())
    for ids in (train_ids, heldout_ids):
        if ids is not None:
            digest.update(ids.to(torch.int64).contiguous().numpy().tobytes())
    return digest.hexdigest()


def _save_checkpoint(path: Path, job: str, stats: dict[str, KVStats], batches_done: int) -> None:
    from safetensors.torch import save

    tensors = {f"{name}.{key}": t.contiguous().cpu() for name, s in stats.items() for key, t in s.state_dict().items()}
    header = {"job": job, "batches_done": str(batches_done), "kvhub_version": __version__}
    atomic_write_bytes(path, save(tensors, metadata=header))


def _load_checkpoint(path: Path, job: str, stats: dict[str, KVStats]) -> int:
    """Fill ``stats`` from a matching checkpoint; returns the number of batches it covers (0 if none)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        return 0
    with safe_open(str(path), framework="pt") as handle:
        header = handle.metadata() or {}
        if header.get("job") != job:
            log.warning("checkpoint %s belongs to another fit; starting from scratch", path)
            return 0
        state = {key: handle.get_tensor(key) for key in handle.keys()}
    for name in stats:
        prefix = f"{name}."
        stats[name] = KVStats.from_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
    return int(header["batches_done"])


# ---- the mapper -------------------------------------------------------------------------------
def target_means(train: KVStats) -> dict[str, torch.Tensor]:
    """``{k,v}.{m}.target_mean`` (Ht*Dt,) fp32: the calibration mean of target layer m's RoPE-stripped
    keys and of its values.  A cache of these constants is the no-information control of an evaluation
    (:mod:`kvhub.eval.control`): what a handoff scores above it is what the mapped context contributes."""
    out = {}
    for kind, moments in (("k", train.k), ("v", train.v)):
        for m in range(train.layout.dst_layers):
            out[tensor_name(map_prefix(kind, m), "target_mean")] = moments.mean_y[train.layout.dst_columns(m)].float().clone()
    return out


def build_mapper(solution: Solution, source_fp: dict, target_fp: dict, calibration: dict,
                 train: KVStats, heldout: KVStats, options: FitOptions) -> Mapper:
    """Weights (fp32) and mapper.json metadata from a solution."""
    tensors = {}
    for layer in solution.layers:
        tensors.update(layer.k_map.tensors(f"k.{layer.target}"))
        tensors.update(layer.v_map.tensors(f"v.{layer.target}"))
    tensors.update(target_means(train))
    r2_k, r2_v = solution.mean_r2()
    metrics = {"train_tokens": train.n, "heldout_tokens": heldout.n}
    if r2_k is not None:
        metrics.update({
            "heldout_r2_k_mean": r2_k, "heldout_r2_v_mean": r2_v,
            "heldout_r2_k_min": min(l.r2_k for l in solution.layers),
            "heldout_r2_v_min": min(l.r2_v for l in solution.layers),
        })
    metadata = {
        "kvhub_version": __version__,
        "kind": "ridge",
        "source": source_fp,
        "target": target_fp,
        "k": solution.k,
        "lambda": solution.lambda_,
        "chosen_by": solution.chosen_by,
        "structure": {"head_groups": solution.structure.groups, "rank": solution.structure.rank},
        "notes": solution.notes,
        "layers": [layer.to_metadata() for layer in solution.layers],
        "probe_r2": {"k": solution.probe_r2_k.tolist(), "v": solution.probe_r2_v.tolist()},
        "calibration": calibration,
        "fit": {"stride": options.stride, "skip_first": options.skip_first, "batch_size": options.batch_size,
                "weighting": options.weighting, "weight_cap": options.weight_cap,
                "timings": {k: round(v, 3) if isinstance(v, float) else v for k, v in options.timings.items()}},
        "metrics": metrics,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    return Mapper(tensors, json.loads(json.dumps(metadata, default=str)))
