"""The target run layer by layer: each decoder layer onloaded to the device once, every calibration batch
through it, the batches' hidden states carried on the host to the next layer (``--target-layout
layer-outer``, for a target larger than one device).

The source's captures come from the two-phase spool (:mod:`kvhub.fitting.phases`): every layer's sweep
reads them again.  Sweep m runs target layer m over every batch (the model's own forward over a one-layer
stack, so masks and rotary embeddings are the model's), strips RoPE from its keys as
:func:`kvhub.core.capture.capture` does, and accumulates layer m's cross moments against every source
layer; sweep 0 also accumulates the source Gram.  The moments of one target layer are a column block of
the whole-model statistics (:class:`kvhub.core.stats.Moments`: Chan merges act column by column), so the
assembled statistics are the whole-model ones up to how an fp32 product of a column block rounds (the
known-answer test compares them at 1e-10).

Only the weights of the layer being swept (and the embedding) are on the device; the target's weights wait
on the host.  The statistics are one pass (two-pass probing, attention weighting and ``--map mlp`` read
every target layer of a batch at once and are refused by name).  Architectures whose forward does nothing
beyond embedding -> decoder layers -> norm are accepted (:data:`LAYER_OUTER_MODELS`).
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from kvhub.core.capture import cache_kwargs, layer_rows, token_mask
from kvhub.core.rope import Rotary
from kvhub.core.stats import F64, KVStats, Layout, Moments
from kvhub.errors import ConfigError
from kvhub.fitting.checkpoint import SPLITS, FitState
from kvhub.progress import Progress, report

log = logging.getLogger(__name__)

LAYER_OUTER_MODELS = ("llama", "mistral", "qwen2", "qwen3")  # embedding -> layers -> norm, nothing else


def check_layer_outer(config, options, mode=None) -> None:
    """Refuse, by name, what a layer-outer target cannot do (``mode``: the statistics mode the fit chose)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in LAYER_OUTER_MODELS:
        raise ConfigError(
            f"--target-layout layer-outer runs {', '.join(LAYER_OUTER_MODELS)} targets, not {model_type!r}; "
            "use --target-layout whole"
        )
    refused = {
        "--stats two-pass": options.statistics == "two-pass"
        or getattr(options.statistics, "passes", 1) == 2
        or getattr(mode, "passes", 1) == 2,
        "--weighting attention": options.weighting == "attention",
        "--map mlp": options.map_kind != "ridge",
    }
    for flag, asked in refused.items():
        if asked:
            raise ConfigError(
                f"{flag} reads every target layer of a batch at once; a layer-outer target sees one layer at a "
                "time: drop it or use --target-layout whole"
            )


@contextlib.contextmanager
def one_layer(body, index: int):
    """``body`` (the model's decoder stack) with layer ``index`` alone and no final norm: its forward over
    ``inputs_embeds`` is that layer's, with the model's own masks and rotary embeddings."""
    layers, norm, config = body.layers, body.norm, body.config
    types = getattr(config, "layer_types", None)
    body.layers, body.norm = torch.nn.ModuleList([layers[index]]), torch.nn.Identity()
    if types is not None:
        config.layer_types = [types[index]]
    try:
        yield
    finally:
        body.layers, body.norm = layers, norm
        if types is not None:
            config.layer_types = types


@torch.no_grad()
def layer_pass(model, index: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decoder layer ``index`` over (B, T, h) hidden states: (its output, its cached keys and values (B, H, T, D))."""
    from transformers import DynamicCache

    body = model.base_model
    cache = DynamicCache()
    positions = torch.arange(hidden.shape[1], device=hidden.device).expand(hidden.shape[0], -1)
    with one_layer(body, index):
        out = body(inputs_embeds=hidden, position_ids=positions, use_cache=True, **cache_kwargs(body, cache))
    layer = cache.layers[index]
    return out.last_hidden_state, layer.keys, layer.values


def accumulate_layer_outer(
    source,
    target_model,
    batches: list[tuple[str, torch.Tensor]],
    layout: Layout,
    *,
    options,
    device,
    dtype: torch.dtype = F64,
    progress: Progress | None = None,
    sweeps: "Sweeps | None" = None,
    notify=None,
) -> FitState:
    """One-pass statistics of ``batches`` (split, (B, T) unpadded ids) with ``source`` a feed of the source's
    captures (:class:`kvhub.fitting.phases.SpooledSource`) and ``target_model`` on the host: each decoder
    layer moved to ``device`` for its sweep and back after (module docstring).  ``sweeps``: where the state
    between two layers is checkpointed (every ``options.checkpoint_every`` layers) and resumed from."""
    body, device = target_model.base_model, torch.device(device)
    embed, rotary = onload_stack(target_model, device)
    resumed = sweeps.load(layout, dtype) if sweeps is not None else None
    if resumed is None:
        start = 0
        hidden = [embed(ids.to(device)).to("cpu") for _, ids in batches]  # carried on the host between layers
        stats = {name: KVStats(layout, dtype=dtype) for name in SPLITS}
    else:
        start, hidden, stats = resumed
        (notify or log.info)(f"resuming the target's sweeps ({start}/{layout.dst_layers} layers done)")
    total = layout.dst_layers * sum(int(ids.numel()) for _, ids in batches)
    done = start * sum(int(ids.numel()) for _, ids in batches)
    for m in range(start, layout.dst_layers):
        layer = body.layers[m].to(device)
        moments = {name: _layer_moments(layout, dtype, gram=m == 0) for name in SPLITS}
        for index, (name, ids) in enumerate(batches):
            report(progress, f"target layer {m + 1}/{layout.dst_layers}: {name} batch {index + 1}", done, total)
            k_rows, v_rows = sweep_batch(target_model, m, hidden, index, ids, rotary, options, device)
            started = time.perf_counter()
            src = source.capture(index, ids)
            for kind, rows, blocks in (("k", k_rows, src.keys), ("v", v_rows, src.values)):
                moments[name][kind].update(torch.cat([b.to(rows.device) for b in blocks], 1), rows)
            options.timings["stats_s"] = options.timings.get("stats_s", 0.0) + time.perf_counter() - started
            done += int(ids.numel())
        body.layers[m].to("cpu")
        del layer
        for name in SPLITS:
            _place(stats[name], moments[name], layout.dst_columns(m), gram=m == 0)
        if sweeps is not None and m + 1 < layout.dst_layers and (m + 1) % options.checkpoint_every == 0:
            sweeps.save(m + 1, hidden, stats)
    report(progress, "target layers: done", done, total)
    options.timings["tokens"] = options.timings.get("tokens", 0) + sum(int(ids.numel()) for _, ids in batches)
    return FitState(stats)


def onload_stack(target_model, device: torch.device):
    """The target's embedding and rotary embedding moved to ``device`` for the whole fit (its decoder layers
    visit one at a time); returns (embedding, :class:`Rotary`)."""
    body = target_model.base_model
    embed = body.embed_tokens.to(device)
    if getattr(body, "rotary_emb", None) is not None:
        body.rotary_emb.to(device)
    return embed, Rotary.from_model(target_model)


def sweep_batch(target_model, m: int, hidden: dict | list, index: int, ids, rotary, options, device):
    """Decoder layer ``m`` over batch ``index``'s hidden states (``hidden[index]``, moved on to the layer's
    output, on the host): that layer's kept K rows (RoPE stripped) and V rows, as
    :func:`kvhub.core.capture.capture` gives them; its time goes to ``forward_s``."""
    started = time.perf_counter()
    out, keys, values = layer_pass(target_model, m, hidden[index].to(device))
    keep = token_mask(torch.ones_like(ids, device=keys.device), stride=options.stride, skip_first=options.skip_first)
    positions = torch.arange(ids.shape[1], device=keys.device).expand_as(keep)
    rows = layer_rows(keys, values, keep, rotary, positions, m)
    hidden[index] = out.to("cpu")
    options.timings["forward_s"] = options.timings.get("forward_s", 0.0) + time.perf_counter() - started
    return rows


def _layer_moments(layout: Layout, dtype: torch.dtype, *, gram: bool) -> dict[str, Moments]:
    p = layout.src_layers * layout.src_width
    return {kind: Moments(p, layout.dst_width, dtype=dtype, gram_blocks=None if gram else 0) for kind in "kv"}


def _place(stats: KVStats, moments: dict[str, Moments], columns: slice, *, gram: bool) -> None:
    """Copy one target layer's moments into its column block of ``stats`` (and the source side, from sweep 0)."""
    for kind in "kv":
        whole, part = getattr(stats, kind), moments[kind]
        whole.cxy[:, columns] = part.cxy
        whole.mean_y[columns] = part.mean_y
        whole.syy[columns] = part.syy
        if gram:
            whole.cxx.copy_(part.cxx)
            whole.mean_x.copy_(part.mean_x)
            whole.n, whole.weight_sum = part.n, part.weight_sum


class Sweeps:
    """A layer-outer fit's state between two target layers, in ``directory`` (inside its spool): per batch
    its hidden states (``hidden-<layers done>-<batch>.safetensors``) and the statistics of the layers swept
    (``sweeps.safetensors``, written last), each file atomic and headed by the job and the layers done.  A
    state whose files do not all read and agree is not resumed (the sweeps start over, with a warning)."""

    STATE = "sweeps.safetensors"

    def __init__(self, directory, job: str, batches: int):
        from pathlib import Path

        self.directory, self.job, self.batches = Path(directory), job, batches

    def _hidden(self, layers_done: int, index: int):
        return self.directory / f"hidden-{layers_done:03d}-{index:05d}.safetensors"

    def save(self, layers_done: int, hidden: list[torch.Tensor], stats: dict[str, KVStats]) -> None:
        from safetensors.torch import save

        from kvhub.artifact.files import atomic_write_bytes

        header = {"job": self.job, "layers_done": str(layers_done)}
        for index, states in enumerate(hidden):
            atomic_write_bytes(self._hidden(layers_done, index), save({"hidden": states.contiguous()}, metadata=header))
        tensors = {f"{name}.{key}": t.contiguous() for name, s in stats.items() for key, t in s.state_dict().items()}
        atomic_write_bytes(self.directory / self.STATE, save(tensors, metadata=header))
        for path in self.directory.glob("hidden-*.safetensors"):  # the previous generation
            if not path.name.startswith(f"hidden-{layers_done:03d}-"):
                path.unlink(missing_ok=True)

    def load(self, layout: Layout, dtype: torch.dtype):
        """(layers done, hidden states by batch, statistics by split), or None: nothing (whole) to resume."""
        from safetensors import SafetensorError, safe_open

        path = self.directory / self.STATE
        if path.is_symlink() or not path.is_file():
            return None
        try:
            with safe_open(str(path), framework="pt") as handle:
                header = handle.metadata() or {}
                tensors = {key: handle.get_tensor(key) for key in handle.keys()}
            done = int(header.get("layers_done", "-1"))
            if header.get("job") != self.job or not 0 < done < layout.dst_layers:
                raise ValueError(f"is of another fit or has layers_done {header.get('layers_done')!r}")
            stats = {
                name: KVStats.from_state_dict(
                    {k[len(name) + 1 :]: v for k, v in tensors.items() if k.startswith(f"{name}.")}
                )
                for name in SPLITS
            }
            if any(s.layout != layout or s.k.cxx.dtype != dtype for s in stats.values()):
                raise ValueError("holds statistics of another layout or dtype")
            if not all(bool(torch.isfinite(t).all()) for t in tensors.values() if t.is_floating_point()):
                raise ValueError("holds non-finite statistics")
            hidden = []
            for index in range(self.batches):
                with safe_open(str(self._hidden(done, index)), framework="pt") as handle:
                    if (handle.metadata() or {}) != {"job": self.job, "layers_done": str(done)}:
                        raise ValueError(f"has hidden states of batch {index} from another sweep")
                    hidden.append(handle.get_tensor("hidden"))
        except (SafetensorError, OSError, ValueError, KeyError) as exc:
            log.warning("layer-outer checkpoint %s %s; the target's sweeps start over", self.directory, exc)
            return None
        return done, hidden, stats
