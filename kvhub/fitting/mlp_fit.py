"""``kvhub fit --map mlp``: a residual MLP per target layer and K/V on top of the solved ridge maps.

After the statistics pass (which also filled the row reservoirs, :mod:`kvhub.fitting.samples`) and the
solve, each target layer m's key and value MLPs are trained (:func:`kvhub.core.mlp.train_residual`) on the
same inputs as its ridge maps: the reservoir's columns of its selected source layers (K RoPE-stripped, V),
against target layer m's, the ridge prediction subtracted; early stopping on the held-out reservoir.  Map
(m, kind) is trained with seed ``mlp_seed + 2 m + (kind == "v")``, whatever order the layers run in.

Resumable: after every finished target layer its MLPs and results are written atomically to
``<checkpoint>.mlp.safetensors`` (header: the job identity, the schedule, the finished layers and their
results); a rerun of the same job (same statistics checkpoint, so the same reservoirs and maps) skips
those layers.  A file of another job or schedule, or one that does not read back, is a warning and a
fresh start.  The held-out R^2 it records is the pooled R^2 on the held-out reservoir (all held-out rows
when there are at most ``--mlp-tokens`` of them), for the MLP map (``r2_k``/``r2_v``) and for the ridge map
alone on the same rows (``ridge_r2_k``/``ridge_r2_v``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

import torch

from kvhub import __version__
from kvhub.artifact import json_sha256, map_prefix, parse_json
from kvhub.artifact.files import atomic_write_if_room
from kvhub.artifact.kinds import MAP_KINDS
from kvhub.artifact.metadata import R2_ROUNDING
from kvhub.core.mapper import Mapper
from kvhub.core.mlp import Schedule, Trained, tensors_of, train_residual
from kvhub.core.solve import LayerSolution, Solution
from kvhub.core.stats import Layout
from kvhub.errors import ConfigError, FitError
from kvhub.fitting.options import MIN_MLP_ROWS
from kvhub.fitting.samples import Reservoir
from kvhub.progress import Progress, report

log = logging.getLogger(__name__)

KINDS = ("k", "v")
_RESULT_FIELDS = ("epochs", "best_epoch", "train_loss", "heldout_loss", "heldout_r2", "ridge_heldout_r2")


def schedule_of(options) -> Schedule:
    """The training schedule a FitOptions asks for."""
    return Schedule(width=options.mlp_width, depth=options.mlp_depth, epochs=options.mlp_epochs, seed=options.mlp_seed)


def check_options(options, *, heldout_sequences: int, distributed: bool = False) -> None:
    """Refuse, before any forward pass, an MLP fit that cannot run: without held-out sequences (early stopping
    needs them) or on several ranks (each rank would see only its share of the rows)."""
    if options.map_kind == "ridge":
        return
    if distributed:
        raise ConfigError(
            f"--map {options.map_kind} does not run distributed yet (its MLPs train on rows sampled in "
            "one process); fit it without --distributed / torchrun, on one GPU or CPU"
        )
    if heldout_sequences < 1:
        raise ConfigError(
            f"--map {options.map_kind} needs held-out calibration sequences: its MLPs stop early on "
            "them; use a calibration set with a held-out split"
        )


def train_maps(
    solution: Solution,
    samples: dict[str, Reservoir],
    layout: Layout,
    options,
    *,
    job: str,
    device: torch.device | str = "cpu",
    progress: Progress | None = None,
) -> dict[int, dict[str, Trained]]:
    """{target layer: {"k": Trained, "v": Trained}} for every layer of ``solution``, resuming from and
    checkpointing to :func:`checkpoint_path` of ``options.checkpoint`` (module docstring)."""
    short = {split: reservoir.size for split, reservoir in samples.items() if reservoir.size < MIN_MLP_ROWS}
    if short:  # R^2 over one row is undefined (its total sum of squares is 0)
        raise FitError(
            f"--map mlp kept {', '.join(f'{n} {split} row(s)' for split, n in short.items())}; the MLPs need at "
            f"least {MIN_MLP_ROWS} rows per split to train and score: use more or longer calibration sequences "
            "(and --mlp-tokens of at least 2)"
        )
    schedule = schedule_of(options)
    path = checkpoint_path(options.checkpoint)
    job = f"{job}:{_solution_key(solution)}"  # the same statistics solved with another k or lambda: other maps
    done = _load(path, job, schedule, solution, layout)
    if done:
        log.info("MLP training resumes: target layers %s already trained", sorted(done))
    for count, layer in enumerate(solution.layers):
        report(
            progress,
            f"mlp: target layer {layer.target} ({count + 1}/{len(solution.layers)})",
            count,
            len(solution.layers),
        )
        if layer.target not in done:
            done[layer.target] = {kind: _train(layer, kind, samples, layout, schedule, device) for kind in KINDS}
            if path is not None:
                _save(path, job, schedule, done)
    report(progress, "mlp: done", len(solution.layers), len(solution.layers))
    return done


def _train(
    layer: LayerSolution, kind: str, samples: dict[str, Reservoir], layout: Layout, schedule: Schedule, device
) -> Trained:
    """Train the residual MLP of one map: inputs, targets and ridge predictions from the reservoirs."""
    splits = [t for split in ("train", "heldout") for t in map_rows(layer, kind, samples[split], layout)]
    seeded = dataclasses.replace(schedule, seed=schedule.seed + 2 * layer.target + KINDS.index(kind))
    trained = train_residual(*splits, schedule=seeded, device=device)
    log.info(
        "mlp %s.%d: held-out R^2 %.4f (ridge %.4f), best epoch %d of %d",
        kind,
        layer.target,
        trained.heldout_r2,
        trained.ridge_heldout_r2,
        trained.best_epoch,
        trained.epochs,
    )
    return trained


def map_rows(layer: LayerSolution, kind: str, reservoir: Reservoir, layout: Layout):
    """(x (n, d_in), y (n, d_out), ridge prediction (n, d_out)) of map (``layer``, ``kind``) on a reservoir's rows:
    its selected source layers' columns, target layer's columns, and x @ W + b of its ridge map."""
    linear = layer.k_map if kind == "k" else layer.v_map
    weight = linear.dense(len(layer.sources), layout.src_width).float()  # (d_in, d_out)
    name = "keys" if kind == "k" else "values"
    x = reservoir.tensors[f"{name}_x"][:, layout.src_columns(layer.sources)]
    y = reservoir.tensors[f"{name}_y"][:, layout.dst_columns(layer.target)]
    return x, y, torch.addmm(linear.bias.float(), x, weight)


def with_mlps(mapper: Mapper, trained: dict[int, dict[str, Trained]], samples: dict[str, Reservoir], options) -> Mapper:
    """A new Mapper: ``mapper``'s ridge maps plus the trained MLPs, its metadata of kind ``mlp`` (the
    ``mlp`` block, per layer ``r2_*`` of the MLP map and ``ridge_r2_*``, the metrics recomputed)."""
    schedule = schedule_of(options)
    tensors = dict(mapper.tensors)
    layers, losses = [], {kind: {"train": [], "heldout": []} for kind in KINDS}
    for layer in mapper.layers:
        entry = dict(layer)
        for kind in KINDS:
            result = trained[layer["target"]][kind]
            tensors.update(tensors_of(map_prefix(kind, layer["target"]), result.layers))
            entry.update(
                {
                    f"r2_{kind}": result.heldout_r2,
                    f"ridge_r2_{kind}": result.ridge_heldout_r2,
                    f"mlp_epochs_{kind}": result.epochs,
                    f"mlp_best_epoch_{kind}": result.best_epoch,
                }
            )
            losses[kind]["train"].append(result.train_loss)
            losses[kind]["heldout"].append(result.heldout_loss)
        layers.append(entry)
    settings = {
        **dataclasses.asdict(schedule),
        "losses": losses,
        "tokens": {split: reservoir.size for split, reservoir in samples.items()},
    }
    fit_block = mapper.metadata["fit"]
    timings = {**fit_block["timings"], "mlp_s": round(options.timings.get("mlp_s", 0.0), 3)}
    metadata = {
        **mapper.metadata,
        "kind": "mlp",
        MAP_KINDS["mlp"].block: settings,
        "layers": layers,
        "metrics": {**mapper.metadata["metrics"], **_metrics(layers)},
        "fit": {**fit_block, "timings": timings},
    }
    return Mapper(tensors, json.loads(json.dumps(metadata)), dtype=mapper.dtype, compute_dtype=mapper.compute_dtype)


def _solution_key(solution: Solution) -> str:
    """What the MLPs are trained on top of: every layer's sources and lambdas, and the maps' structure."""
    record = [(l.target, l.sources, l.k_map.ridge_lambda, l.v_map.ridge_lambda) for l in solution.layers]
    record.append(dataclasses.asdict(solution.structure))
    return json_sha256(record)[:16]


def _metrics(layers: list[dict]) -> dict[str, float]:
    """heldout_r2_{k,v}_{mean,min} of the MLP maps, and ridge_heldout_r2_{k,v}_mean on the same rows."""
    out = {}
    for kind in KINDS:
        mlp, ridge = [l[f"r2_{kind}"] for l in layers], [l[f"ridge_r2_{kind}"] for l in layers]
        out.update(
            {
                f"heldout_r2_{kind}_mean": sum(mlp) / len(mlp),
                f"heldout_r2_{kind}_min": min(mlp),
                f"ridge_heldout_r2_{kind}_mean": sum(ridge) / len(ridge),
            }
        )
    return out


# ---- the per-layer checkpoint ----------------------------------------------------------------------
def _results_problem(entry, schedule: Schedule) -> str | None:
    """What is wrong with one map's recorded results (None: nothing): the fields of Trained, ``epochs`` an
    integer in 1..schedule.epochs, ``best_epoch`` in 0..epochs, losses finite >= 0, R^2 finite and at most 1
    (what mapper.json will require of them)."""
    if not isinstance(entry, dict) or set(entry) != set(_RESULT_FIELDS):
        return f"are not an object of {', '.join(_RESULT_FIELDS)}"
    epochs, best = entry["epochs"], entry["best_epoch"]
    if not (_is_integer(epochs) and 1 <= epochs <= schedule.epochs):
        return f"have epochs {epochs!r}, not an integer in 1..{schedule.epochs}"
    if not (_is_integer(best) and 0 <= best <= epochs):
        return f"have best_epoch {best!r}, not an integer in 0..{epochs}"
    for name in ("train_loss", "heldout_loss"):
        if not (_is_number(entry[name]) and entry[name] >= 0):
            return f"have {name} {entry[name]!r}, not a finite number >= 0"
    for name in ("heldout_r2", "ridge_heldout_r2"):
        if not (_is_number(entry[name]) and entry[name] <= 1 + R2_ROUNDING):
            return f"have {name} {entry[name]!r}, not a finite number <= 1"
    return None


def _is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def checkpoint_path(statistics_checkpoint: Path | None) -> Path | None:
    """``<key>.mlp.safetensors`` beside the statistics checkpoint ``<key>.safetensors`` (None: none)."""
    if statistics_checkpoint is None:
        return None
    path = Path(statistics_checkpoint)
    return path.with_name(f"{path.stem}.mlp{path.suffix or '.safetensors'}")


def _save(path: Path, job: str, schedule: Schedule, done: dict[int, dict[str, Trained]]) -> None:
    from safetensors.torch import save as to_bytes

    if path.is_dir():
        return
    tensors, results = {}, {}
    for target, maps in done.items():
        for kind, trained in maps.items():
            tensors.update(tensors_of(map_prefix(kind, target), trained.layers))
            results[f"{kind}.{target}"] = {name: getattr(trained, name) for name in _RESULT_FIELDS}
    header = {
        "job": job,
        "schedule": json.dumps(dataclasses.asdict(schedule), sort_keys=True),
        "results": json.dumps(results, sort_keys=True),
        "kvhub_version": __version__,
    }
    atomic_write_if_room(path, to_bytes(tensors, metadata=header), then="the MLP training goes on without it")


def _load(path: Path | None, job: str, schedule: Schedule, solution: Solution, layout: Layout) -> dict:
    """The finished layers a checkpoint of this job and schedule holds ({} when none; a warning when one is
    unusable)."""
    from safetensors import SafetensorError, safe_open

    if path is None or not path.is_file():
        return {}
    try:
        with safe_open(str(path), framework="pt") as handle:
            header = handle.metadata() or {}
            if header.get("job") != job or header.get("schedule") != json.dumps(
                dataclasses.asdict(schedule), sort_keys=True
            ):
                log.warning("MLP checkpoint %s belongs to another fit; training every layer", path)
                return {}
            results = parse_json(header["results"])
            return _restore(handle, results, schedule, solution, layout)
    except (SafetensorError, OSError, KeyError, TypeError, ValueError) as exc:
        log.warning("MLP checkpoint %s does not read back (%s); training every layer", path, exc)
        return {}


def _restore(handle, results: dict, schedule: Schedule, solution: Solution, layout: Layout) -> dict:
    """Trained maps of the layers ``results`` lists, read from ``handle``, checked (shapes, finite; the results
    by :func:`_results_problem`: a layer whose results are not is trained again)."""
    if not isinstance(results, dict):
        raise ValueError(f"its results are {type(results).__name__}, not an object")
    done = {}
    for layer in solution.layers:
        if not all(f"{kind}.{layer.target}" in results for kind in KINDS):
            continue
        problems = [_results_problem(results[f"{kind}.{layer.target}"], schedule) for kind in KINDS]
        if any(problems):
            log.warning(
                "MLP checkpoint: target layer %d's recorded results %s; training it again",
                layer.target,
                next(p for p in problems if p),
            )
            continue
        maps = {}
        for kind in KINDS:
            d_in, d_out = len(layer.sources) * layout.src_width, layout.dst_width
            parts = MAP_KINDS["mlp"].parts(dataclasses.asdict(schedule), d_in, d_out)
            tensors = {part: handle.get_tensor(f"{map_prefix(kind, layer.target)}.{part}") for part in parts}
            if any(tuple(t.shape) != parts[p] or not bool(torch.isfinite(t).all()) for p, t in tensors.items()):
                raise ValueError(f"target layer {layer.target}'s {kind} MLP has the wrong shapes or non-finite values")
            count = len(parts) // 2
            layers = [(tensors[f"mlp.{i}.weight"], tensors[f"mlp.{i}.bias"]) for i in range(count)]
            maps[kind] = Trained(layers=layers, **results[f"{kind}.{layer.target}"])
        done[layer.target] = maps
    return done
