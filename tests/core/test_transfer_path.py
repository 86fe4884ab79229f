"""The transfer path (Mapper.map_layers / transfer): layers stripped and re-rotated together per shared
cos/sin, batch > 1 at per-row positions, writing into a preallocated cache, one finiteness check.

Mappers here are built from configs with random weights (no fit): the path is a deterministic function of
the weights, so each test compares it with an independent per-layer / per-row computation of the same map.
The pair is Gemma 3-like: local (sliding) and global layers with different RoPE, on both sides.
"""

import pytest
import torch
from transformers import DynamicCache

import kvhub.core.mapper as mapper_module
from kvhub.errors import IncompatibleError, NonFiniteError
from kvhub.core.fingerprint import model_fingerprint
from kvhub.core.mapper import Mapper
from kvhub.core.rope import Rotary, apply_rope, strip_rope
from tests.tinymodels import make_config
from tests.tolerances import assert_close, rtol

LOCAL, GLOBAL = "sliding_attention", "full_attention"
WINDOW = 8


def _config(layer_types, *, kv_heads, head_dim):
    return make_config(
        "gemma3_text",
        num_hidden_layers=len(layer_types),
        layer_types=list(layer_types),
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        sliding_window=WINDOW,
    )


SOURCE = _config([LOCAL, GLOBAL, LOCAL], kv_heads=2, head_dim=16)
TARGET = _config([LOCAL, GLOBAL, LOCAL, GLOBAL], kv_heads=4, head_dim=32)
STRUCTURES = {
    "dense": {},
    "head-local": {"groups": 2},
    "low-rank": {"rank": 8},
    "head-local-low-rank": {"groups": 2, "rank": 4},
}


def _random_mapper(source=SOURCE, target=TARGET, *, k=2, groups=None, rank=None, sources=None, seed=0):
    """Random maps of one structure; target layer m reads ``sources[m]`` (default: k consecutive layers)."""
    gen = torch.Generator().manual_seed(seed)
    fingerprints = [model_fingerprint(config, model_id=name) for config, name in ((source, "t/src"), (target, "t/dst"))]
    for fingerprint in fingerprints:
        fingerprint["dtype"] = "float32"
    src, dst = fingerprints
    width_in, width_out = src["num_kv_heads"] * src["head_dim"], dst["num_kv_heads"] * dst["head_dim"]
    layers, tensors = [], {}
    for m in range(dst["num_layers"]):
        chosen = sources[m] if sources is not None else [(m + j) % src["num_layers"] for j in range(k)]
        layers.append({"target": m, "sources": chosen})
        fan_in = len(chosen) * width_in
        for kind in ("k", "v"):
            tensors[f"{kind}.{m}.bias"] = torch.randn(width_out, generator=gen)
            shapes = [(fan_in, width_out)] if rank is None else [(fan_in, rank), (rank, width_out)]
            if groups is not None:
                shapes = [
                    (groups, rows // groups if i == 0 else rows, cols // groups if i == len(shapes) - 1 else cols)
                    for i, (rows, cols) in enumerate(shapes)
                ]
            names = ["weight"] if rank is None else ["weight_a", "weight_b"]
            for name, shape in zip(names, shapes):
                tensors[f"{kind}.{m}.{name}"] = torch.randn(*shape, generator=gen) / shape[-2] ** 0.5
    return Mapper(tensors, {"source": src, "target": dst, "layers": layers})


def _source_cache(batch, tokens, *, seed=1, config=SOURCE):
    gen = torch.Generator().manual_seed(seed)
    cache = DynamicCache()
    shape = (batch, config.num_key_value_heads, tokens, config.head_dim)
    for layer in range(config.num_hidden_layers):
        cache.update(torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen), layer)
    return cache


def _row(cache, row):
    single = DynamicCache()
    for index, layer in enumerate(cache.layers):
        single.update(layer.keys[row : row + 1].clone(), layer.values[row : row + 1].clone(), index)
    return single


def _gemm_terms(mapper):
    """The longest dot product of a map: its input width (k source layers of Hs*Ds)."""
    k = max(len(layer["sources"]) for layer in mapper.layers)
    return k * mapper.source["num_kv_heads"] * mapper.source["head_dim"]


def test_identity_maps_round_trip_rope_per_layer_type():
    """Known answer.  A self map with identity weights: target layer m reads source layer perm[m], so its
    keys must be source keys stripped with perm[m]'s RoPE and re-rotated with m's, values unchanged; where
    perm[m] == m that is the cache itself.  Layers of both types are stripped/applied together per type."""
    perm = [[1], [0], [2]]  # local 0 and global 1 swap; local 2 reads itself
    mapper = _random_mapper(SOURCE, SOURCE, sources=perm)
    width = SOURCE.num_key_value_heads * SOURCE.head_dim
    mapper.tensors = {
        name: (torch.eye(width) if name.endswith("weight") else torch.zeros(width)) for name in mapper.tensors
    }
    cache = _source_cache(2, 12)
    positions = torch.arange(12).expand(2, 12) + torch.tensor([[0], [5]])
    keys = [layer.keys for layer in cache.layers]
    mapped = mapper.map_layers(keys, [layer.values for layer in cache.layers], positions)
    rotary = Rotary.from_config(SOURCE)
    for m, ((got_k, got_v), [l]) in enumerate(zip(mapped, perm)):
        expected = apply_rope(strip_rope(keys[l], *rotary.cos_sin(positions, l)), *rotary.cos_sin(positions, m))
        assert_close(got_k, expected, terms=width, msg=f"keys of layer {m}")
        assert torch.equal(got_v, cache.layers[l].values)
    assert_close(mapped[2][0], keys[2], terms=width)  # the round trip
    assert not torch.allclose(mapped[1][0], keys[0], atol=0.1)  # the two types' RoPE do differ


def _dense_equivalent(mapper, kind, m):
    """The (k*Hs*Ds, out) matrix a stored map stands for: low rank multiplied out, head groups placed on
    the block diagonal (group g: its Hs/groups heads of every source layer -> its Ht/groups heads)."""
    tensors = {name.split(".")[-1]: t for name, t in mapper.tensors.items() if name.startswith(f"{kind}.{m}.")}
    weight = tensors["weight"] if "weight" in tensors else tensors["weight_a"] @ tensors["weight_b"]
    if weight.dim() == 2:
        return weight
    groups, rows_per_group, cols_per_group = weight.shape
    width = mapper.source["num_kv_heads"] * mapper.source["head_dim"]
    k, step = rows_per_group * groups // width, width // groups
    dense = torch.zeros(k * width, groups * cols_per_group)
    for g in range(groups):
        for j in range(k):
            dense[j * width + g * step : j * width + (g + 1) * step, g * cols_per_group : (g + 1) * cols_per_group] = (
                weight[g, j * step : (j + 1) * step]
            )
    return dense


@pytest.mark.parametrize("structure", STRUCTURES, ids=list(STRUCTURES))
def test_every_structure_applies_the_dense_map_it_stands_for(structure):
    """Known answer: _affine on the k = 2 source blocks equals [x_1 | x_2] @ W + b with W written out densely."""
    mapper = _random_mapper(**STRUCTURES[structure])
    gen = torch.Generator().manual_seed(8)
    parts = [torch.randn(3, 5, 32, generator=gen) for _ in range(2)]
    for kind in ("k", "v"):
        expected = torch.cat(parts, dim=-1) @ _dense_equivalent(mapper, kind, 1) + mapper.tensors[f"{kind}.1.bias"]
        assert_close(mapper._affine(parts, kind, 1), expected, terms=_gemm_terms(mapper), msg=kind)


@pytest.mark.parametrize("structure", STRUCTURES, ids=list(STRUCTURES))
def test_batch_of_three_matches_per_row_transfers(structure):
    """Rows at different positions (offsets, and a left-padded row) map as they would alone."""
    mapper = _random_mapper(**STRUCTURES[structure])
    tokens = 14
    cache = _source_cache(3, tokens)
    positions = torch.stack([torch.arange(tokens), torch.arange(tokens) + 9, (torch.arange(tokens) - 4).clamp(min=0)])
    batched = mapper.transfer(cache, position_ids=positions)
    assert batched.layers[0].is_sliding and batched.layers[0].keys.shape == (3, 4, WINDOW - 1, 32)
    for row in range(3):
        alone = mapper.transfer(_row(cache, row), position_ids=positions[row : row + 1])
        for m, (got, want) in enumerate(zip(batched.layers, alone.layers)):
            assert_close(got.keys[row : row + 1], want.keys, terms=_gemm_terms(mapper), msg=f"row {row} keys {m}")
            assert_close(got.values[row : row + 1], want.values, terms=_gemm_terms(mapper), msg=f"row {row} values {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transfer_into_a_preallocated_cache_writes_in_place(dtype):
    mapper = _random_mapper(**STRUCTURES["head-local"])
    first, second = _source_cache(2, 20, seed=3), _source_cache(2, 20, seed=4)
    cache = mapper.transfer(first, dtype=dtype)
    pointers = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]
    assert mapper.transfer(second, out=cache) is cache
    assert [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers] == pointers
    fresh = mapper.transfer(second, dtype=dtype)
    for m, (got, want) in enumerate(zip(cache.layers, fresh.layers)):
        assert got.keys.dtype == dtype and got.get_seq_length() == 20
        # the windowed layers map only their last WINDOW - 1 tokens: other GEMM sizes, same formula
        assert_close(got.keys, want.keys, dtype=dtype, terms=_gemm_terms(mapper), msg=f"keys {m}")
        assert_close(got.values, want.values, dtype=dtype, terms=_gemm_terms(mapper), msg=f"values {m}")
        assert not torch.equal(got.keys, mapper.transfer(first, dtype=dtype).layers[m].keys)


def test_map_layers_into_tensors_equals_the_allocating_path():
    mapper = _random_mapper(**STRUCTURES["low-rank"])
    cache = _source_cache(1, 16, seed=5)
    keys, values = [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]
    positions = torch.arange(16)[None] + 3
    expected = mapper.map_layers(keys, values, positions)
    out = [(torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))) for k, v in expected]
    pointers = [(k.data_ptr(), v.data_ptr()) for k, v in out]
    assert mapper.map_layers(keys, values, positions, out=out) is out
    assert [(k.data_ptr(), v.data_ptr()) for k, v in out] == pointers
    for (got_k, got_v), (want_k, want_v) in zip(out, expected):
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_out_that_does_not_fit_is_refused():
    mapper = _random_mapper()
    source = _source_cache(2, 20)
    with pytest.raises(IncompatibleError, match="same length"):
        mapper.transfer(source, out=mapper.transfer(_source_cache(2, 19)))
    with pytest.raises(IncompatibleError, match="shape"):
        mapper.transfer(source, out=mapper.transfer(_source_cache(1, 20)))
    with pytest.raises(IncompatibleError, match="dtype"):
        mapper.transfer(source, out=mapper.transfer(source), dtype="bfloat16")
    keys, values = [layer.keys for layer in source.layers], [layer.values for layer in source.layers]
    with pytest.raises(IncompatibleError, match="one per target layer"):
        mapper.map_layers(keys, values, torch.arange(20)[None], out=[(keys[0], values[0])])


def test_chunked_layers_give_the_same_bits(monkeypatch):
    """One layer per chunk (the bound long contexts hit) computes what whole groups compute."""
    mapper = _random_mapper(**STRUCTURES["dense"])
    cache = _source_cache(2, 10, seed=6)
    whole = mapper.transfer(cache)
    monkeypatch.setattr(mapper_module, "_CHUNK_ELEMENTS", 1)
    for got, want in zip(mapper.transfer(cache).layers, whole.layers):
        assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)


@pytest.mark.parametrize("chunk_elements", [1, 1 << 26])
def test_non_finite_source_names_the_first_bad_layer_read(monkeypatch, chunk_elements):
    monkeypatch.setattr(mapper_module, "_CHUNK_ELEMENTS", chunk_elements)
    mapper = _random_mapper(k=1)  # reads source layers 0, 1, 2, 0
    cache = _source_cache(2, 10)
    cache.layers[2].keys[1, 0, 3, 0] = float("nan")
    cache.layers[1].values[0, 1, 9, 5] = float("inf")
    with pytest.raises(NonFiniteError, match="source cache layer 1 contains NaN or Inf"):
        mapper.transfer(cache)
    cache.layers[1].values[0, 1, 9, 5] = 0.0
    with pytest.raises(NonFiniteError, match="source cache layer 2 "):
        mapper.transfer(cache)
    unread = _random_mapper(sources=[[0], [1], [0], [1]])
    assert unread.transfer(cache).get_seq_length() == 10  # a layer no map reads is not checked


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_mapper_takes_a_host_cache_with_one_host_synchronisation():
    """A host cache mapped on CUDA into a preallocated cache: the result of the CPU path (at TF32/bf16-class
    GEMM precision), pointers kept, and torch's sync debug mode sees one synchronisation (the finiteness
    check): the host stages through pinned memory and never waits per layer."""
    import warnings

    mapper = _random_mapper(**STRUCTURES["head-local"])
    cache = _source_cache(3, 40, seed=7)
    positions = torch.arange(40).expand(3, 40) + torch.tensor([[0], [3], [11]])
    on_cpu = mapper.transfer(cache, position_ids=positions)
    gpu = _random_mapper(**STRUCTURES["head-local"]).to("cuda")
    out = gpu.transfer(cache, position_ids=positions)
    pointers = [layer.keys.data_ptr() for layer in out.layers]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gpu.transfer(cache, position_ids=positions, out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
    assert [layer.keys.data_ptr() for layer in out.layers] == pointers
    tolerance = rtol(torch.float16, terms=_gemm_terms(mapper))
    for got, want in zip(out.layers, on_cpu.layers):
        for name in ("keys", "values"):
            expected = getattr(want, name)
            torch.testing.assert_close(
                getattr(got, name).cpu(), expected, rtol=tolerance, atol=tolerance * float(expected.abs().max())
            )
    cache.layers[1].values[2, 0, 5, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="source cache layer 1 "):
        gpu.transfer(cache, out=out)


def test_bf16_block_products_are_summed_in_fp32_like_one_gemm():
    """k = 12 source blocks in bf16: the summed products must be as accurate as one GEMM over the
    concatenated blocks (k roundings to bf16 would add ~70% more error here)."""
    from kvhub.core.mapper import _summed

    generator = torch.Generator().manual_seed(0)
    xs = [torch.randn(2048, 128, generator=generator) for _ in range(12)]
    weight = torch.randn(12 * 128, 256, generator=generator) / (12 * 128) ** 0.5
    exact = torch.cat(xs, 1).double() @ weight.double()
    one_gemm = (torch.cat(xs, 1).bfloat16() @ weight.bfloat16()).double()
    blocks = weight.bfloat16().split(128)
    summed = _summed(x.bfloat16() @ block for x, block in zip(xs, blocks)).double()

    def error(y):
        return float((y - exact).norm() / exact.norm())

    assert error(summed) <= 1.05 * error(one_gemm)
