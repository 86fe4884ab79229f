"""kvhub hands caches to transformers under the keyword the installed version takes (capture.cache_kwargs).

transformers before 5.20 calls it ``past_key_values`` and silently ignores ``cache=``: the forward then
fills a cache of its own and the one kvhub passed stays empty.  These tests run on whatever transformers
is installed (the main venv and the vLLM venv pin different ones; scripts/test-vllm.sh runs this file too).
"""

import pytest
import torch
from transformers import DynamicCache

from kvhub.core.capture import cache_kwargs, capture, run_model
from kvhub.errors import UnsupportedModelError
from tests.tinymodels import make_model


def test_run_model_fills_every_layer():
    model = make_model("qwen2")
    cache = run_model(model, torch.randint(0, 128, (2, 9)))
    assert len(cache.layers) == model.config.num_hidden_layers
    assert cache.get_seq_length() == 9
    captured = capture(model, torch.randint(0, 128, (1, 5)))
    assert len(captured.keys) == model.config.num_hidden_layers and captured.tokens == 5


def test_continuing_a_cache_through_cache_kwargs_matches_one_forward():
    model = make_model("llama")
    ids = torch.randint(0, 128, (1, 12))
    cache = DynamicCache()
    model(input_ids=ids[:, :8], use_cache=True, **cache_kwargs(model, cache))
    assert cache.get_seq_length() == 8
    continued = model(input_ids=ids[:, 8:], use_cache=True, **cache_kwargs(model, cache)).logits
    assert cache.get_seq_length() == 12
    torch.testing.assert_close(continued, model(input_ids=ids).logits[:, 8:], rtol=1e-4, atol=1e-5)


def test_generate_continues_the_given_cache():
    model = make_model("qwen2")
    ids = torch.randint(0, 128, (1, 10))
    cache = run_model(model, ids[:, :-1])
    mask = torch.ones_like(ids)
    with_cache = model.generate(
        ids, attention_mask=mask, max_new_tokens=6, do_sample=False, **cache_kwargs(model, cache)
    )
    assert cache.get_seq_length() == 10 + 6 - 1
    assert torch.equal(with_cache, model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False))


class _TakesCache(torch.nn.Module):
    def forward(self, input_ids=None, cache=None, **kwargs):
        return None


class _TakesPastKeyValues(torch.nn.Module):
    def forward(self, input_ids=None, past_key_values=None, **kwargs):
        return None


@pytest.mark.parametrize("model_class, keyword", [(_TakesCache, "cache"), (_TakesPastKeyValues, "past_key_values")])
def test_cache_kwargs_follows_the_forward_signature(model_class, keyword):
    sentinel = object()
    assert cache_kwargs(model_class(), sentinel) == {keyword: sentinel}


def test_an_ignored_cache_is_refused_not_returned_empty(monkeypatch):
    model = make_model("qwen2")
    monkeypatch.setattr("kvhub.core.capture.cache_kwargs", lambda model, cache: {"unknown_cache_keyword": cache})
    with pytest.raises(UnsupportedModelError, match="left its cache empty"):
        run_model(model, torch.randint(0, 128, (1, 6)))
