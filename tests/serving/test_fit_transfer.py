"""End to end on tiny models: fit -> Mapper -> transfer / handoff, exact where an exact map exists."""

import pytest
import torch

from kvhub.core.capture import cache_kwargs, run_model
from kvhub.errors import ConfigError, IncompatibleError, IntegrityError, FormatVersionError, NonFiniteError
from kvhub.fitting.fit import fit
from kvhub.fitting.options import FitOptions
from kvhub.serving.handoff import handoff
from kvhub.core.mapper import Mapper
from kvhub.core.control import control_mapper
from tests.tinymodels import exact_family_target, make_model
from tests.tolerances import assert_close, cache_condition, rtol
from tests.fixtures_fit import fit_tiny, token_ids as _ids

TRAIN_TOKENS, HELDOUT_TOKENS = 24 * 32, 6 * 32  # of _fit
# R^2 from fp32 moment products over the held-out tokens (both signs: rounding can push it past 1)
R2_TOL = rtol(torch.float32, terms=HELDOUT_TOKENS)


def _fit(source, target, *, k=None, lam=1e-9, **options):
    return fit_tiny(source, target, top_k=k, ridge_lambda=lam, **options)


def _greedy(model, ids, cache=None, n=12):
    kwargs = cache_kwargs(model, cache) if cache is not None else {}
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, **kwargs)


@pytest.fixture(scope="module")
def qwen_family():
    source = make_model("qwen2", num_hidden_layers=3)
    target, layer_map = exact_family_target(source, insert_before=(1,), kv_repeat=2, double_head_dim=True)
    return source, target, layer_map, _fit(source, target)


def test_exact_family_recovers_layers_and_r2_one(qwen_family):
    _, _, layer_map, mapper = qwen_family
    for layer, expected in zip(mapper.layers, layer_map):
        assert expected in layer["sources"]
        assert abs(1 - layer["r2_k"]) < R2_TOL and abs(1 - layer["r2_v"]) < R2_TOL


def test_exact_family_transferred_cache_matches_target_cache(qwen_family):
    source, target, _, mapper = qwen_family
    ids = _ids(2, 40, 7)
    mapped = mapper.transfer(run_model(source, ids))
    own = run_model(target, ids)
    # the map is solved from fp32 moments over the training tokens; rounding grows with the source's conditioning
    condition = cache_condition(source, _ids(24, 32, 0))
    for m, (a, b) in enumerate(zip(mapped.layers, own.layers)):
        assert_close(a.keys, b.keys, terms=TRAIN_TOKENS, condition=condition, msg=f"keys of layer {m}")
        assert_close(a.values, b.values, terms=TRAIN_TOKENS, condition=condition, msg=f"values of layer {m}")


def test_exact_family_greedy_generation_identical(qwen_family):
    source, target, _, mapper = qwen_family
    for seed in range(3):
        ids = _ids(1, 30, 10 + seed)
        own = _greedy(target, ids)
        cache = mapper.transfer(run_model(source, ids[:, :-1]))
        assert torch.equal(_greedy(target, ids, cache), own)
        assert torch.equal(
            handoff(mapper, source, target, ids, exact_prefix=0, exact_suffix=0, max_new_tokens=12, do_sample=False),
            own,
        )


def test_llama_family_with_two_inserted_layers():
    source = make_model("llama", num_hidden_layers=3, seed=3)
    target, layer_map = exact_family_target(source, insert_before=(0, 2), kv_repeat=1, double_head_dim=True)
    mapper = _fit(source, target)
    assert [l["sources"] for l in mapper.layers] and all(
        expected in l["sources"] for l, expected in zip(mapper.layers, layer_map)
    )
    ids = _ids(1, 25, 5)
    assert torch.equal(
        handoff(mapper, source, target, ids, exact_prefix=0, exact_suffix=0, max_new_tokens=10, do_sample=False),
        _greedy(target, ids, n=10),
    )


@pytest.mark.parametrize(
    "model_type,kwargs", [("qwen3", {"head_dim": 16}), ("mistral", {"sliding_window": 8, "head_dim": 16})]
)
def test_self_map_is_identity(model_type, kwargs):
    model = make_model(model_type, **kwargs)
    mapper = _fit(model, model, k=1)
    assert [l["sources"] for l in mapper.layers] == [[m] for m in range(model.config.num_hidden_layers)]
    ids = _ids(1, 30, 3)
    assert torch.equal(
        handoff(mapper, model, model, ids, exact_prefix=0, exact_suffix=0, max_new_tokens=10, do_sample=False),
        _greedy(model, ids, n=10),
    )


def test_sliding_window_target_cache_is_windowed():
    model = make_model("mistral", sliding_window=8, head_dim=16)
    mapper = _fit(model, model, k=1)
    cache = mapper.transfer(run_model(model, _ids(1, 30, 2)))
    assert cache.layers[0].is_sliding and cache.layers[0].keys.shape[-2] == 7


def _forward_tol(model) -> float:
    """Rounding of a tiny fp32 model's K/V: the longest dot products (MLP width) in every layer."""
    return rtol(torch.float32, terms=model.config.intermediate_size * model.config.num_hidden_layers)


def _same_positions(got, want, tolerance: float) -> torch.Tensor:
    """(T,) True where every head and dim of ``got`` equals ``want`` within rtol = atol / max|want|."""
    scale = float(want.abs().max())
    return torch.isclose(got, want, rtol=tolerance, atol=tolerance * scale).all(-1).all(1).all(0)


def test_exact_prefix_handoff_on_the_exact_family_generates_as_the_target(qwen_family):
    """End to end (the mapped cache is the target's own here, so this checks the path, not the recompute:
    test_exact_prefix_positions_are_the_targets_own_and_the_mapped_ones_are_not does)."""
    source, target, _, mapper = qwen_family
    ids = _ids(1, 30, 21)
    out = handoff(mapper, source, target, ids, exact_prefix=4, exact_suffix=0, max_new_tokens=10, do_sample=False)
    assert torch.equal(out, _greedy(target, ids, n=10))


def test_exact_prefix_positions_are_the_targets_own_and_the_mapped_ones_are_not(qwen_family):
    """Over a zero-information control map: a recompute that did nothing would leave the control's K/V."""
    from kvhub.serving.handoff import prepare_cache
    from kvhub.serving.spec import Recompute

    source, target, _, mapper = qwen_family
    ids = _ids(1, 30, 21)
    own = run_model(target, ids[:, :-1])
    cache = prepare_cache(
        control_mapper(mapper), source, target, ids, recompute=Recompute(exact_prefix=4, exact_suffix=0)
    )
    for m, (got, want) in enumerate(zip(cache.layers, own.layers)):
        for name in ("keys", "values"):
            same = _same_positions(getattr(got, name), getattr(want, name), _forward_tol(target))
            assert same[:4].all() and not same[4:].any(), f"{name} of layer {m}: {same.tolist()}"


def test_exact_suffix_handoff_on_the_exact_family_generates_as_the_target(qwen_family):
    """End to end (the mapped cache is the target's own here, so this checks the path, not the recompute:
    test_exact_suffix_positions_are_recomputed_over_the_mapped_cache does)."""
    source, target, _, mapper = qwen_family
    ids = _ids(1, 30, 22)
    out = handoff(mapper, source, target, ids, exact_prefix=2, exact_suffix=5, max_new_tokens=10, do_sample=False)
    assert torch.equal(out, _greedy(target, ids, n=10))


def test_exact_suffix_positions_are_recomputed_over_the_mapped_cache(qwen_family):
    """Over a zero-information control map.  Layer 0 K/V depend on a position's own token only, so there the
    recomputed suffix equals the target's own; deeper, the suffix attends to the control middle, so it is
    neither the target's own nor what the control map alone put there."""
    from kvhub.serving.handoff import prepare_cache
    from kvhub.serving.spec import Recompute

    source, target, _, mapper = qwen_family
    control = control_mapper(mapper)
    ids = _ids(1, 30, 22)
    own = run_model(target, ids[:, :-1])
    mapped_only = prepare_cache(control, source, target, ids, recompute=Recompute(exact_prefix=2, exact_suffix=0))
    cache = prepare_cache(control, source, target, ids, recompute=Recompute(exact_prefix=2, exact_suffix=5))
    tolerance = _forward_tol(target)
    for m, (got, want, plain) in enumerate(zip(cache.layers, own.layers, mapped_only.layers)):
        for name in ("keys", "values"):
            same_as_own = _same_positions(getattr(got, name), getattr(want, name), tolerance)
            same_as_map = _same_positions(getattr(got, name), getattr(plain, name), tolerance)
            assert same_as_own[:2].all() and not same_as_own[2:24].any(), f"{name} of layer {m}"
            assert same_as_map[:24].all() and not same_as_map[24:].any(), f"{name} of layer {m}"
            assert same_as_own[24:].all() == (m == 0), f"{name} of layer {m}"


def test_handoff_defaults_cap_to_short_prompts(qwen_family):
    """A context shorter than the default exact prefix + suffix (4 + 16) is recomputed whole: over the
    zero-information control map the handoff still generates as the target.  The cap keeps the prefix
    before the suffix (Recompute.capped).  Planted bugs caught: refusing p + s beyond the context; a cap
    that leaves context positions to the map; a cap that shortens the prefix to make room for the suffix."""
    from kvhub.serving.spec import HANDOFF, Recompute

    source, target, _, mapper = qwen_family
    for n in (3, 11):  # 2 and 10 context tokens
        ids = _ids(1, n, 24)
        assert torch.equal(
            handoff(mapper, source, target, ids, max_new_tokens=4, do_sample=False), _greedy(target, ids, n=4)
        )
        assert torch.equal(
            handoff(control_mapper(mapper), source, target, ids, max_new_tokens=4, do_sample=False),
            _greedy(target, ids, n=4),
        )
    assert (HANDOFF.capped(10).exact_prefix, HANDOFF.capped(10).exact_suffix) == (4, 6)
    assert (HANDOFF.capped(2).exact_prefix, HANDOFF.capped(2).exact_suffix) == (2, 0)
    assert HANDOFF.capped(100) == HANDOFF and Recompute(0, 16).capped(5).exact_suffix == 5


def test_exact_recompute_replaces_exactly_the_named_tokens(qwen_family):
    """With a useless map (zero weights) only the recomputed positions hold the target's own K/V."""
    from kvhub.serving.handoff import prepare_cache
    from kvhub.serving.spec import Recompute

    source, target, _, mapper = qwen_family
    broken = Mapper({name: torch.zeros_like(t) for name, t in mapper.tensors.items()}, mapper.metadata)
    ids = _ids(1, 20, 23)
    own = run_model(target, ids[:, :-1])
    cache = prepare_cache(broken, source, target, ids, recompute=Recompute(exact_prefix=3, exact_suffix=4))
    assert cache.get_seq_length() == 19
    tolerance = _forward_tol(target)
    for got, want in zip(cache.layers, own.layers):
        same = _same_positions(got.keys, want.keys, tolerance)
        assert same[:3].all() and not same[3:15].any()
        assert got.values[:, :, 3:15].abs().max() == 0  # the mapped middle: zero weights, zero bias
    first = cache.layers[0]  # the suffix attends to the mapped middle, so only layer 0 keys/values match own
    assert _same_positions(first.keys, own.layers[0].keys, tolerance)[15:].all()
    full = prepare_cache(broken, source, target, ids, recompute=Recompute(exact_prefix=10, exact_suffix=9))
    for got, want in zip(full.layers, own.layers):  # nothing left to map: the target's own prefill
        assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
    with pytest.raises(ConfigError, match="exact_suffix"):
        prepare_cache(mapper, source, target, ids, recompute=Recompute(exact_suffix=20))


def test_batch_transfer_and_position_ids(qwen_family):
    """Each row of a batch transfer is placed at its own ``position_ids``.  The control map's key is its mean
    key rotated by the target's RoPE at the token's position (its weights are zero, so the source cache does not
    matter), so 10 tokens transferred at positions 40.. (row 0) and 7.. (row 1) must carry the keys that a
    50-token transfer at the default positions holds there.  Planted bugs caught: transfer passing the default
    range 0..T-1 to map_layers whatever position_ids it was given, or row 0's positions for every row."""
    source, _, _, mapper = qwen_family
    control = control_mapper(mapper)
    ids = _ids(2, 50, 4)
    full = control.transfer(run_model(source, ids))
    positions = torch.stack([torch.arange(40, 50), torch.arange(7, 17)])
    placed = control.transfer(run_model(source, ids[:, :10]), position_ids=positions)
    assert placed.layers[0].keys.shape == (2, 4, 10, 32)
    for got, want in zip(placed.layers, full.layers):
        for row in range(2):
            torch.testing.assert_close(got.keys[row], want.keys[row][:, positions[row]])
            assert not torch.allclose(got.keys[row], want.keys[row][:, :10])  # the keys do rotate with position
    with pytest.raises(IncompatibleError, match="position_ids"):
        mapper.transfer(run_model(source, ids), position_ids=torch.arange(5)[None])


def test_save_load_round_trip_and_integrity(qwen_family, tmp_path):
    source, _, _, mapper = qwen_family
    path = mapper.save(tmp_path / "m")
    loaded = Mapper.load(path)
    ids = _ids(1, 12, 9)
    a = mapper.transfer(run_model(source, ids))
    b = loaded.transfer(run_model(source, ids))
    torch.testing.assert_close(a.layers[2].keys, b.layers[2].keys)
    assert loaded.metadata["tensors"]["sha256"] and loaded.metadata["format_version"] == 3
    data = bytearray((path / "mapper.safetensors").read_bytes())
    data[-3] ^= 0xFF
    (path / "mapper.safetensors").write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="sha256"):
        Mapper.load(path)


def test_newer_format_version_refused(qwen_family, tmp_path):
    import json

    path = qwen_family[3].save(tmp_path / "m")
    meta = json.loads((path / "mapper.json").read_text())
    meta["format_version"] = 99
    (path / "mapper.json").write_text(json.dumps(meta))
    with pytest.raises(FormatVersionError, match="upgrade"):
        Mapper.load(path)


def test_wrong_cache_geometry_refused(qwen_family):
    _, target, _, mapper = qwen_family
    with pytest.raises(IncompatibleError, match="layers"):
        mapper.transfer(run_model(target, _ids(1, 8, 1)))


def test_non_finite_source_cache_refused(qwen_family):
    source, _, _, mapper = qwen_family
    cache = run_model(source, _ids(1, 8, 1))
    cache.layers[1].values[0, 0, 3, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="NaN"):
        mapper.transfer(cache)


def test_different_tokenizers_refused_before_any_forward():
    from kvhub.fitting.fit import check_same_tokenizer

    with pytest.raises(IncompatibleError, match="a/src.*b/dst|different tokenizers"):
        check_same_tokenizer(
            {"model_id": "a/src", "tokenizer_hash": "1" * 64}, {"model_id": "b/dst", "tokenizer_hash": "2" * 64}
        )


def test_resume_from_checkpoint_gives_same_mapper(tmp_path):
    source = make_model("qwen2", num_hidden_layers=2)
    target = make_model("qwen2", num_hidden_layers=3, seed=5)
    clean = _fit(source, target, lam=0.01, k=2)
    checkpoint = tmp_path / "ckpt.safetensors"

    class Killed(Exception):
        pass

    calls = []

    def kill_after_two(phase, done, total):
        calls.append(done)
        if len(calls) == 3:  # after two batches (and their checkpoint)
            raise Killed

    with pytest.raises(Killed):
        fit_tiny(
            source,
            target,
            progress=kill_after_two,
            top_k=2,
            ridge_lambda=0.01,
            checkpoint=checkpoint,
            checkpoint_every=1,
        )
    assert checkpoint.is_file()
    resumed_calls = []
    resumed = fit_tiny(
        source,
        target,
        progress=lambda *a: resumed_calls.append(a),
        top_k=2,
        ridge_lambda=0.01,
        checkpoint=checkpoint,
        checkpoint_every=1,
    )
    assert resumed_calls[0][1] == 2 * 8 * 32  # started after the two checkpointed batches
    for name, tensor in clean.tensors.items():  # same batches merged in the same order: the same bits
        assert torch.equal(resumed.tensors[name], tensor), name


def test_handoff_refuses_another_tokenizer():
    from kvhub.core.fingerprint import tokenizer_hash
    from tests.fixtures_calib import train_tokenizer

    model = make_model("qwen2", num_hidden_layers=1, vocab_size=640)
    fitted_with, other = train_tokenizer(vocab_size=600), train_tokenizer(vocab_size=620)
    mapper = fit(
        model,
        model,
        _ids(12, 16, 0),
        _ids(4, 16, 1),
        source_id="a/src",
        target_id="a/dst",
        source_tokenizer=fitted_with,
        target_tokenizer=fitted_with,
        options=FitOptions(top_k=1, ridge_lambda=0.01, stride=1),
    )
    assert mapper.source["tokenizer_hash"] == tokenizer_hash(fitted_with)
    ids = _ids(1, 10, 2)
    handoff(mapper, model, model, ids, tokenizer=fitted_with, max_new_tokens=2, do_sample=False)
    with pytest.raises(IncompatibleError, match="a/src"):
        handoff(mapper, model, model, ids, tokenizer=other, max_new_tokens=2)


def test_a_map_whose_output_overflows_is_refused_not_returned(qwen_family):
    """R5: a finite source cache, a finite but huge weight, float16 output: Inf would reach the target's cache."""
    import torch

    from kvhub.core.mapper import Mapper

    source, _, _, mapper = qwen_family
    tensors = {name: t.clone() for name, t in mapper.tensors.items()}
    name = next(n for n in tensors if n.startswith("k.") and n.endswith(".weight"))
    tensors[name] = tensors[name] * 1e30
    damaged = Mapper(tensors, mapper.metadata, dtype=mapper.dtype, compute_dtype=torch.float32)
    cache = run_model(source, _ids(1, 8, 1))
    mapper.transfer(cache, dtype=torch.float16)  # the real map fits float16
    with pytest.raises(NonFiniteError, match=f"target layer {name.split('.')[1]} hold NaN or Inf"):
        damaged.transfer(cache, dtype=torch.float16)
