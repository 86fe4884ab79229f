"""Mapper.transfer hands its ``position_ids`` to the map: a known answer at offset positions through transfer
itself (test_transfer_path.py checks map_layers directly; this is the path from transfer to it)."""

import torch
from transformers import DynamicCache

from kvhub.core.capture import cache_kwargs
from tests.fixtures_fit import fit_tiny
from tests.tinymodels import exact_family_target, make_model
from tests.tolerances import rtol


def _cache_at(model, ids: torch.Tensor, positions: torch.Tensor) -> DynamicCache:
    """The model's own cache of ``ids`` (B, T) placed at ``positions`` (B, T) (a continuation's tokens)."""
    cache = DynamicCache()
    with torch.no_grad():
        model.base_model(input_ids=ids, position_ids=positions, use_cache=True, **cache_kwargs(model.base_model, cache))
    return cache


def test_transfer_at_offset_positions_is_the_targets_own_cache_there():
    """On an exact family the mapped cache of tokens placed at positions 40.. (row 0) and 7.. (row 1) equals the
    target's own cache of them there, keys included (the source's RoPE stripped, the target's applied at those
    positions), and the positions map_layers receives are the ones given.  The tiny family's RoPE is the same
    on both sides (a wrong position cancels out in the keys), so the hand-over itself is watched.  Planted bug
    caught: transfer passing the default range to map_layers whatever position_ids it was given."""
    torch.manual_seed(0)
    source = make_model("qwen2", num_hidden_layers=2)
    target, _ = exact_family_target(source, insert_before=(1,), kv_repeat=2, double_head_dim=True)
    train = torch.randint(0, 128, (16, 32), generator=torch.Generator().manual_seed(1))
    mapper = fit_tiny(source, target, train=train[:12], heldout=train[12:], ridge_lambda=1e-9)
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(2))
    positions = torch.stack([torch.arange(40, 50), torch.arange(7, 17)])
    handed = []
    real = mapper.map_layers
    mapper.map_layers = lambda keys, values, position_ids, **kw: (
        handed.append(position_ids),
        real(keys, values, position_ids, **kw),
    )[1]
    mapped = mapper.transfer(_cache_at(source, ids, positions), position_ids=positions)
    assert len(handed) == 1 and torch.equal(handed[0].cpu(), positions)
    own = _cache_at(target, ids, positions)
    tolerance = 1e3 * rtol(torch.float32, terms=12 * 32)
    for got, want in zip(mapped.layers, own.layers):
        scale = float(want.keys.abs().max())
        assert torch.allclose(got.keys, want.keys, atol=tolerance * scale, rtol=tolerance)
        assert torch.allclose(got.values, want.values, atol=tolerance * float(want.values.abs().max()), rtol=tolerance)
