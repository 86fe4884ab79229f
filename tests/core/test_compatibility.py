"""check_models compares the models handed to handoff/prepare_cache with the fingerprints the mapper was
fitted for: geometry, model type, and each config field that changes the KV cache, named in the error."""

from __future__ import annotations

import pytest

from kvhub.errors import IncompatibleError
from kvhub.serving.handoff import check_models
from kvhub.core.mapper import Mapper
from tests.fixtures_store import _GEOMETRY, DST_ID, SRC_ID, make_store_artifact


def _model(model_id: str, **changes):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**{"intermediate_size": 64, "vocab_size": 100, **_GEOMETRY[model_id], **changes})
    return Qwen2ForCausalLM(config)


@pytest.fixture(scope="module")
def mapper(tmp_path_factory):
    return Mapper.load(make_store_artifact(tmp_path_factory.mktemp("compat") / "m", seed=51))


def test_the_fitted_models_pass(mapper):
    check_models(mapper, _model(SRC_ID), _model(DST_ID))


@pytest.mark.parametrize(
    "side, changes, words",
    [
        ("source", {"rope_theta": 500000.0}, "source model's config has rope_parameters="),
        ("target", {"vocab_size": 101}, "target model's config has vocab_size=101"),
        ("target", {"intermediate_size": 128}, "target model's config has intermediate_size=128"),
        ("source", {"rms_norm_eps": 1e-3}, "rms_norm_eps=0.001"),
        ("source", {"num_key_value_heads": 4}, "layers/kv_heads/head_dim (2, 4, 8)"),
    ],
)
def test_a_model_with_another_config_is_refused_naming_the_field(mapper, side, changes, words):
    source = _model(SRC_ID, **(changes if side == "source" else {}))
    target = _model(DST_ID, **(changes if side == "target" else {}))
    with pytest.raises(IncompatibleError) as refused:
        check_models(mapper, source, target)
    assert words in str(refused.value)
