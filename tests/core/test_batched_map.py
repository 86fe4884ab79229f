"""The batched transfer of dense ridge maps (kvhub.core.batched_map): the per-layer loop's result, in a number
of operators that does not grow with the target's depth; every other kind of map still takes the loop.

Mappers are planted (random maps, no fit) on tiny qwen2 configs, whose layers share one RoPE: the loop path
(Mapper._target_layers, forced by batched_map._ENABLED = False) is the reference, and tests/core/
test_transfer_path.py checks that loop against independent per-layer computations.
"""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvhub.core.batched_map as batched_map
import kvhub.core.mapper as mapper_module
from kvhub.artifact import map_prefix, tensor_name
from kvhub.core.batched_map import stacked_maps
from kvhub.core.mapper import Mapper
from kvhub.errors import NonFiniteError
from tests.core.test_transfer_path import _gemm_terms, _random_mapper, _source_cache
from tests.tinymodels import make_config
from tests.tolerances import assert_close

SOURCE = make_config("qwen2", num_hidden_layers=3, num_key_value_heads=2, head_dim=16)


def _target(layers: int):
    return make_config("qwen2", num_hidden_layers=layers, num_key_value_heads=4, head_dim=32)


def _planted(target_layers=4, *, kind="ridge", seed=0, deshrink=None, **structure):
    """A random mapper of ``structure`` (k, groups, rank, sources: as _random_mapper) from SOURCE to a qwen2 target
    of ``target_layers`` layers, with calibration means and R^2 < 1 (so de-shrinking rescales every map); kind
    "mlp" adds a random residual MLP (width 8, depth 1) to every map."""
    base = _random_mapper(SOURCE, _target(target_layers), seed=seed, **structure)
    gen = torch.Generator().manual_seed(seed + 100)
    tensors, metadata = dict(base.tensors), dict(base.metadata)
    metadata["layers"] = [{**layer, "r2_k": 0.5, "r2_v": 0.36} for layer in base.layers]
    for layer in base.layers:
        for kv in "kv":
            prefix = map_prefix(kv, layer["target"])
            bias = tensors[tensor_name(prefix, "bias")]
            tensors[tensor_name(prefix, "target_mean")] = torch.randn(bias.shape, generator=gen)
            if kind == "mlp":
                d_in = len(layer["sources"]) * SOURCE.num_key_value_heads * SOURCE.head_dim
                for i, shape in enumerate([(d_in, 8), (8, bias.shape[0])]):
                    tensors[tensor_name(prefix, f"mlp.{i}.weight")] = torch.randn(shape, generator=gen) / 8
                    tensors[tensor_name(prefix, f"mlp.{i}.bias")] = torch.randn(shape[1], generator=gen) / 8
    if kind == "mlp":
        metadata.update(kind="mlp", mlp={"width": 8, "depth": 1, "activation": "gelu"})
    return Mapper(tensors, metadata, deshrink=deshrink)


def _kv(cache):
    return [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]


def _looped(monkeypatch, run, *args):
    """``run(*args)`` with the per-layer loop forced."""
    with monkeypatch.context() as patch:
        patch.setattr(batched_map, "_ENABLED", False)
        return run(*args)


@pytest.mark.parametrize("deshrink", ["kv", "off"])
@pytest.mark.parametrize("k", [1, 2, "mixed"])
def test_batched_maps_equal_the_per_layer_loop(monkeypatch, k, deshrink):
    """Known answer: the loop's result, to fp32 GEMM tolerance, for 2 rows at different position offsets:
    allocated (map_layers), in place into a transferred cache (transfer(out=), pointers kept), and into out
    tensors that keep only the last 5 tokens.  Target layer m reads source layers (m + j) % 3, so a map's
    blocks are out of layer order (m = 2, k = 2 reads 2 then 0).  Planted bugs caught: source blocks gathered
    in sorted rather than ``sources`` order; the stacked bias (or weight) read without de-shrinking; target
    RoPE at the first rather than the last kept positions; position_ids of row 0 used for every row; with
    ``mixed`` k (as a fit picks it per layer), padding blocks that are not zero or a shorter map's weight
    written at the wrong rows."""
    structure = dict(sources=[[0], [0, 1], [1, 2, 0], [2]]) if k == "mixed" else dict(k=k)
    mapper = _planted(deshrink=deshrink, **structure)
    looping = _planted(deshrink=deshrink, **structure)  # its own: the stack shares its memory with the casts
    tokens = 12
    cache = _source_cache(2, tokens, config=SOURCE)
    positions = torch.arange(tokens).expand(2, tokens) + torch.tensor([[3], [20]])
    keys, values = _kv(cache)
    assert stacked_maps(mapper, torch.float32, [tokens] * 4) is not None  # the batched path is the one tested
    terms = _gemm_terms(mapper)

    def allocated(mapper):
        return mapper.map_layers(keys, values, positions)

    def in_place(mapper):
        first = mapper.transfer(_source_cache(2, tokens, seed=9, config=SOURCE))
        pointers = [layer.keys.data_ptr() for layer in first.layers]
        assert mapper.transfer(cache, position_ids=positions, out=first) is first
        assert [layer.keys.data_ptr() for layer in first.layers] == pointers
        return [(layer.keys, layer.values) for layer in first.layers]

    def last_five(mapper):
        out = [(torch.full((2, 4, 5, 32), float("nan")), torch.full((2, 4, 5, 32), float("nan"))) for _ in range(4)]
        assert mapper.map_layers(keys, values, positions, out=out) is out
        return out

    for run in (allocated, in_place, last_five):
        got, want = run(mapper), _looped(monkeypatch, run, looping)
        for m, ((got_k, got_v), (want_k, want_v)) in enumerate(zip(got, want)):
            assert_close(got_k, want_k, terms=terms, msg=f"{run.__name__}: keys of layer {m}")
            assert_close(got_v, want_v, terms=terms, msg=f"{run.__name__}: values of layer {m}")


def test_bf16_batched_maps_are_as_accurate_as_the_loop(monkeypatch):
    """In bf16 (weights, GEMMs and cache) the batched map is at least as close to the fp32 map as the loop
    is (one rounding of the GEMM's fp32 accumulation; the loop rounds each block product once more).  Planted
    bugs caught: the k block products rounded to bf16 and summed in bf16; the bias added after rounding."""
    mapper = _planted(k=3, deshrink="off")
    cache = _source_cache(2, 64, config=SOURCE)
    exact = mapper.map_layers(*_kv(cache), torch.arange(64)[None], dtype=torch.float32)

    def error(mapped):
        return max(
            float((got.double() - want.double()).norm() / want.double().norm())
            for pair, reference in zip(mapped, exact)
            for got, want in zip(pair, reference)
        )

    def bf16():
        return _planted(k=3, deshrink="off").map_layers(*_kv(cache), torch.arange(64)[None], dtype=torch.bfloat16)

    batched, looped = error(bf16()), error(_looped(monkeypatch, bf16))
    assert 0 < batched <= 1.02 * looped, (batched, looped)


@pytest.mark.parametrize("chunk_elements", [1, 1 << 26])
def test_chunks_of_layers_and_non_finite_layers_named(monkeypatch, chunk_elements):
    """One layer per chunk (the bound long contexts hit) maps as whole stacks do, and the finiteness checks
    name the first bad source layer read (target layer m reads source layer m % 3) and the target layer
    whose fp16 output overflows.  Planted bugs caught: chunks past the first written at the first one's
    layers; the source finiteness of keys only; the output's finiteness of keys only, or in reverse layer
    order."""
    mapper = _planted(k=1)
    cache = _source_cache(2, 10, config=SOURCE)
    whole = mapper.map_layers(*_kv(cache), torch.arange(10)[None])
    monkeypatch.setattr(mapper_module, "_CHUNK_ELEMENTS", chunk_elements)
    assert stacked_maps(mapper, torch.float32, [10] * 4) is not None
    for m, (got, want) in enumerate(zip(mapper.map_layers(*_kv(cache), torch.arange(10)[None]), whole)):
        assert_close(got[0], want[0], terms=_gemm_terms(mapper), msg=f"keys of layer {m}")
        assert_close(got[1], want[1], terms=_gemm_terms(mapper), msg=f"values of layer {m}")
    loud = _planted(k=1)
    loud.tensors = {**loud.tensors, "v.2.weight": loud.tensors["v.2.weight"] * 1e6}
    with pytest.raises(NonFiniteError, match="mapped K/V of target layer 2 "):
        loud.transfer(cache, dtype=torch.float16)
    cache.layers[2].keys[1, 0, 3, 0] = float("nan")
    cache.layers[1].values[0, 1, 9, 5] = float("inf")
    with pytest.raises(NonFiniteError, match="source cache layer 1 contains NaN or Inf"):
        mapper.transfer(cache)
    cache.layers[1].values[0, 1, 9, 5] = 0.0
    with pytest.raises(NonFiniteError, match="source cache layer 2 "):
        mapper.transfer(cache)


FALLBACKS = {
    "mlp": dict(kind="mlp", k=2),
    "low-rank": dict(k=2, rank=8),
    "head-local": dict(k=2, groups=2),
}


@pytest.mark.parametrize("structure", FALLBACKS, ids=list(FALLBACKS))
def test_other_maps_take_the_loop_and_keep_their_results(monkeypatch, structure):
    """An mlp map, low-rank and head-local maps run the per-layer loop and give its
    bits, de-shrunk, allocated and in place.  Planted bugs caught: an mlp mapper stacked as ridge (its
    residual term dropped); low-rank or head-local factors stacked as one dense weight."""
    mapper = _planted(**FALLBACKS[structure])
    cache = _source_cache(2, 10, config=SOURCE)
    loops = []
    real = Mapper._target_layers
    monkeypatch.setattr(Mapper, "_target_layers", lambda self, *args: loops.append(1) or real(self, *args))
    got = mapper.transfer(cache)
    mapper.transfer(cache, out=got)
    assert len(loops) == 2
    want = _looped(monkeypatch, lambda: mapper.transfer(cache))
    for m, (a, b) in enumerate(zip(got.layers, want.layers)):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), f"layer {m}"


class _Operators(TorchDispatchMode):
    """Counts the aten operators dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func] += 1
        return func(*args, **(kwargs or {}))


def _operators(target_layers: int, tokens: int = 1024) -> int:
    """aten operators of one transfer(out=) of a k = 2 planted mapper onto a target of ``target_layers`` layers."""
    mapper = _planted(target_layers, k=2)
    cache = _source_cache(1, tokens, config=SOURCE)
    out = mapper.transfer(cache)  # warm: the stacked weights are built at first use
    with _Operators() as counted:
        mapper.transfer(cache, out=out)
    return sum(counted.calls.values())


def test_operators_per_transfer_do_not_grow_with_depth(monkeypatch):
    """transfer(out=) of 1024 tokens onto 24 target layers dispatches fewer than one more aten operator per added
    layer than onto 3 (measured: 123 and 123), where the per-layer loop dispatches about 40 per layer (211 and
    1093).  Without out the batched path measured 135 and 219: DynamicCache.update's per-layer concatenation,
    outside the map.  Planted bugs caught: out's keys written by one copy per layer; the finiteness checked
    per layer; the stack rebuilt on every call."""
    shallow, deep = _operators(3), _operators(24)
    assert deep < shallow + 21, (shallow, deep)
    loop_shallow, loop_deep = _looped(monkeypatch, lambda: (_operators(3), _operators(24)))
    assert loop_deep >= loop_shallow + 21 * 20, (loop_shallow, loop_deep)  # what the batched path removes


def test_transfer_hands_the_mapped_tensors_to_the_cache_and_it_grows_as_updated():
    """transfer's DynamicCache holds the mapped tensors themselves (no concatenation copy), and behaves as one
    that ``update`` filled: its length, a decoding step appending after the mapped tokens.  Planted
    bugs caught: a layer marked initialised with no tensors; the sequence length not what update would leave;
    a copy per layer (the pointer check)."""
    mapper = _planted(k=2)
    cache = mapper.transfer(_source_cache(1, 9, config=SOURCE))
    mapped = mapper.map_layers(*_kv(_source_cache(1, 9, config=SOURCE)), torch.arange(9)[None])
    first = cache.layers[0].keys
    assert cache.get_seq_length() == 9 and all(layer.is_initialized for layer in cache.layers)
    assert all(torch.equal(layer.keys, keys) for layer, (keys, _) in zip(cache.layers, mapped))
    assert cache.layers[1].keys.data_ptr() == first.data_ptr() + first.numel() * first.element_size()
    step = torch.ones(1, 4, 1, 32)
    keys, values = cache.update(step, step, 2)
    assert keys.shape[-2] == 10 and torch.equal(keys[:, :, -1:], step) and cache.get_seq_length(2) == 10
    assert cache.get_seq_length(1) == 9
