"""De-shrunk transfer (Mapper.deshrink, kvhub.core.mapper.DESHRINK): mean + (prediction - mean) / sqrt(R^2) per
target layer, checked against that formula on a fitted tiny pair whose R^2 is well below 1 (so every layer is
really rescaled); the default, the stored tensors left as fitted, and the refusals."""

import math

import pytest
import torch

from kvhub.artifact import map_prefix, tensor_name
from kvhub.core.capture import run_model
from kvhub.core.control import control_mapper
from kvhub.core.mapper import DESHRINK_DEFAULT, Mapper
from kvhub.errors import ConfigError
from kvhub.fitting.fit import fit
from kvhub.fitting.options import FitOptions
from tests.tinymodels import make_model


def _ids(n, seed):
    return torch.randint(0, 128, (n, 32), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def fitted():
    source, target = make_model(seed=1, num_hidden_layers=2), make_model(seed=2, num_hidden_layers=3)
    mapper = fit(
        source,
        target,
        _ids(24, 0),
        _ids(6, 1),
        source_id="a",
        target_id="b",
        options=FitOptions(stride=1, batch_size=8),
    )
    return mapper, source


def _rows(tensor):  # (B, H, T, D) -> (B, T, H*D)
    return tensor.transpose(1, 2).reshape(tensor.shape[0], tensor.shape[2], -1)


@pytest.mark.parametrize("kinds", ["v", "kv"])
def test_values_follow_the_formula_and_keys_only_when_asked(fitted, kinds):
    mapper, source = fitted
    x = _ids(2, 5)
    plain = mapper.deshrunk("off").transfer(run_model(source, x))
    shrunk = mapper.deshrunk(kinds).transfer(run_model(source, x))
    for layer in mapper.layers:
        m = layer["target"]
        assert layer["r2_v"] < 0.9  # a real rescale, not 1
        scale = 1 / math.sqrt(max(layer["r2_v"], 0.25))
        mean = mapper.tensors[tensor_name(map_prefix("v", m), "target_mean")]
        expected = mean + scale * (_rows(plain.layers[m].values) - mean)
        torch.testing.assert_close(_rows(shrunk.layers[m].values), expected, rtol=1e-5, atol=1e-5)
        same_keys = torch.equal(shrunk.layers[m].keys, plain.layers[m].keys)
        assert same_keys == (kinds == "v")


def test_the_default_applies_to_fitted_and_loaded_mappers_and_saving_keeps_the_fitted_maps(fitted, tmp_path):
    mapper, source = fitted
    assert DESHRINK_DEFAULT == "kv" and mapper.deshrink == "kv"
    loaded = Mapper.load(mapper.deshrunk("v").save(tmp_path / "m"))
    assert loaded.deshrink == DESHRINK_DEFAULT  # a transfer setting, not part of the artifact
    assert all(torch.equal(loaded.tensors[n], t) for n, t in mapper.tensors.items())
    x = _ids(1, 7)
    a, b = mapper.transfer(run_model(source, x)), loaded.transfer(run_model(source, x))
    assert all(torch.equal(p.keys, q.keys) and torch.equal(p.values, q.values) for p, q in zip(a.layers, b.layers))
    off = Mapper.load(tmp_path / "m", deshrink="off").transfer(run_model(source, x))
    assert not torch.equal(off.layers[0].keys, a.layers[0].keys)


def test_moving_the_mapper_keeps_the_setting(fitted):
    """A setting other than the default ("v"), used once before the move (so its rescaled tensors exist),
    then moved and cast: it transfers as a fresh deshrunk("v"), not as the default.  Planted bugs caught:
    Mapper.to() resetting ``deshrink`` to the default; to() keeping the rescaled tensors of before the move."""
    mapper, source = fitted
    assert DESHRINK_DEFAULT != "v"
    x = _ids(1, 8)
    cache = run_model(source, x)
    moving = mapper.deshrunk("v")
    moving.transfer(cache)
    moved = moving.to("cpu", torch.float64)
    got, fresh = moved.transfer(cache), mapper.deshrunk("v").transfer(cache)
    default = mapper.deshrunk(DESHRINK_DEFAULT).transfer(cache)
    assert moved.deshrink == "v"
    for a, b in zip(got.layers, fresh.layers):
        torch.testing.assert_close(a.keys.float(), b.keys)
        torch.testing.assert_close(a.values.float(), b.values)
    assert not torch.allclose(got.layers[1].keys.float(), default.layers[1].keys)  # "kv" rescales keys too


def test_the_control_map_is_unchanged_and_the_original_untouched(fitted):
    mapper, source = fitted
    before = {name: t.clone() for name, t in mapper.tensors.items()}
    shrunk = mapper.deshrunk()
    x = _ids(1, 6)
    shrunk.transfer(run_model(source, x))
    assert all(torch.equal(before[name], t) for name, t in mapper.tensors.items())
    assert all(torch.equal(before[name], t) for name, t in shrunk.tensors.items())
    a = control_mapper(mapper.deshrunk("off")).transfer(run_model(source, x))
    b = control_mapper(shrunk).transfer(run_model(source, x))
    assert all(torch.equal(p.keys, q.keys) and torch.equal(p.values, q.values) for p, q in zip(a.layers, b.layers))
    # the control's own maps (zero weights, bias = mean) de-shrunk are the mean again
    forced = control_mapper(mapper).deshrunk("kv").transfer(run_model(source, x))
    assert all(torch.allclose(p.keys, q.keys, atol=1e-6) for p, q in zip(a.layers, forced.layers))


def test_bad_settings_and_a_mapper_without_means(fitted):
    mapper, _ = fitted
    with pytest.raises(ConfigError, match="use one of kv, v, off"):
        mapper.deshrunk("q")
    meanless_tensors = {n: t for n, t in mapper.tensors.items() if not n.endswith("target_mean")}
    meanless = Mapper(meanless_tensors, mapper.metadata)
    assert meanless.deshrink == "off"  # an older artifact maps as fitted by default
    with pytest.raises(ConfigError, match="target_mean"):
        meanless.deshrunk()
    with pytest.raises(ConfigError, match="target_mean"):
        Mapper(meanless_tensors, mapper.metadata, deshrink="v")


def test_kvhub_deshrink_sets_the_default_and_an_explicit_choice_wins(fitted, monkeypatch):
    mapper, _ = fitted
    monkeypatch.setenv("KVHUB_DESHRINK", "off")
    assert Mapper(mapper.tensors, mapper.metadata).deshrink == "off"
    assert Mapper(mapper.tensors, mapper.metadata, deshrink="v").deshrink == "v"
    monkeypatch.setenv("KVHUB_DESHRINK", "yes")
    with pytest.raises(ConfigError, match="KVHUB_DESHRINK='yes': use one of kv, v, off"):
        Mapper(mapper.tensors, mapper.metadata)
    monkeypatch.setenv("KVHUB_DESHRINK", "")
    assert Mapper(mapper.tensors, mapper.metadata).deshrink == DESHRINK_DEFAULT
