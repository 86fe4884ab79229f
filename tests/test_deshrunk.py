"""Mapper.deshrunk: mean + (prediction - mean) / sqrt(R^2) per target layer, checked against that formula
on a fitted tiny pair whose R^2 is well below 1 (so every layer is really rescaled)."""

import math

import pytest
import torch

from kvhub.artifact import map_prefix, tensor_name
from kvhub.core.capture import run_model
from kvhub.core.control import control_mapper
from kvhub.errors import ConfigError
from kvhub.fitting.fit import fit
from kvhub.fitting.options import FitOptions
from tests.tinymodels import make_model


def _ids(n, seed):
    return torch.randint(0, 128, (n, 32), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def fitted():
    source, target = make_model(seed=1, num_hidden_layers=2), make_model(seed=2, num_hidden_layers=3)
    mapper = fit(source, target, _ids(24, 0), _ids(6, 1), source_id="a", target_id="b",
                 options=FitOptions(stride=1, batch_size=8))
    return mapper, source


def _rows(tensor):  # (B, H, T, D) -> (B, T, H*D)
    return tensor.transpose(1, 2).reshape(tensor.shape[0], tensor.shape[2], -1)


@pytest.mark.parametrize("kinds", ["v", "kv"])
def test_values_follow_the_formula_and_keys_only_when_asked(fitted, kinds):
    mapper, source = fitted
    x = _ids(2, 5)
    plain, shrunk = mapper.transfer(run_model(source, x)), mapper.deshrunk(kinds).transfer(run_model(source, x))
    for layer in mapper.layers:
        m = layer["target"]
        assert layer["r2_v"] < 0.9  # a real rescale, not 1
        scale = 1 / math.sqrt(max(layer["r2_v"], 0.25))
        mean = mapper.tensors[tensor_name(map_prefix("v", m), "target_mean")]
        expected = mean + scale * (_rows(plain.layers[m].values) - mean)
        torch.testing.assert_close(_rows(shrunk.layers[m].values), expected, rtol=1e-5, atol=1e-5)
        same_keys = torch.equal(shrunk.layers[m].keys, plain.layers[m].keys)
        assert same_keys == (kinds == "v")


def test_the_control_map_is_unchanged_and_the_original_untouched(fitted):
    mapper, source = fitted
    before = {name: t.clone() for name, t in mapper.tensors.items()}
    shrunk = mapper.deshrunk()
    assert all(torch.equal(before[name], t) for name, t in mapper.tensors.items())
    x = _ids(1, 6)
    a = control_mapper(mapper).transfer(run_model(source, x))
    b = control_mapper(shrunk).transfer(run_model(source, x))
    assert all(torch.equal(p.keys, q.keys) and torch.equal(p.values, q.values) for p, q in zip(a.layers, b.layers))


def test_bad_kinds_and_a_mapper_without_means_are_refused(fitted):
    mapper, _ = fitted
    with pytest.raises(ConfigError, match="use 'kv'"):
        mapper.deshrunk("q")
    meanless = type(mapper)({n: t for n, t in mapper.tensors.items() if not n.endswith("target_mean")}, mapper.metadata)
    with pytest.raises(ConfigError, match="target_mean"):
        meanless.deshrunk()
