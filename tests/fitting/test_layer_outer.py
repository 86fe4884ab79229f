"""A target run layer by layer (kvhub.fitting.layer_outer): each decoder layer swept over every batch, the
hidden states carried between layers.  Its statistics equal the whole-model ones, its mapper the one-phase
mapper, and what it cannot do is refused by name."""

import dataclasses

import pytest
import torch

from kvhub.errors import ConfigError
from kvhub.fitting.fit import fit
from kvhub.fitting.layer_outer import accumulate_layer_outer, check_layer_outer, layer_pass
from kvhub.fitting.modes import ONE_PASS, StatisticsMode
from kvhub.fitting.options import FitOptions
from kvhub.fitting.phases import spooled
from tests.fixtures_fit import assert_same_statistics, live_and_spooled
from tests.tinymodels import make_model


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVHUB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _family(kind: str):
    source = make_model(kind, num_hidden_layers=3, seed=2)
    target = make_model(kind, num_hidden_layers=4, num_key_value_heads=4, seed=3)
    ids = torch.randint(0, 128, (26, 12), generator=torch.Generator().manual_seed(0))
    return source, target, ids[:20], ids[20:]


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def families(request):
    """Both architectures: what the layer's own forward computes must not depend on the model's."""
    return _family(request.param)


@pytest.fixture(scope="module")
def family():
    return _family("qwen2")


def _options(**changes) -> FitOptions:
    base = FitOptions(top_k=2, ridge_lambda=0.01, stride=2, batch_size=2, statistics=ONE_PASS)
    return dataclasses.replace(base, **changes)


def test_a_layers_pass_is_the_whole_models_layer(families):
    _, target, train, _ = families
    from kvhub.core.capture import run_model

    whole = run_model(target, train[:2])
    hidden = target.base_model.embed_tokens(train[:2])
    for m in range(4):
        hidden, keys, values = layer_pass(target, m, hidden)
        torch.testing.assert_close(keys, whole.layers[m].keys, rtol=0, atol=1e-6)
        torch.testing.assert_close(values, whole.layers[m].values, rtol=0, atol=1e-6)


def test_layer_outer_statistics_equal_the_whole_model_statistics(families):
    source, target, train, heldout = families
    options = _options()
    layout, batches, whole, spool = live_and_spooled(source, target, train, heldout, options, job="s")
    outer = accumulate_layer_outer(spooled(source, spool), target, batches, layout, options=options, device="cpu")
    assert_same_statistics(whole, outer, atol=1e-10)
    assert outer.stats["train"].n == 20 * 6


def test_layer_outer_fit_gives_the_one_phase_mapper(family):
    one = fit(*family, source_id="s", target_id="d", options=_options(capture="one-phase"))
    outer = fit(*family, source_id="s", target_id="d", options=_options(target_layout="layer-outer"))
    for name, tensor in one.tensors.items():
        torch.testing.assert_close(outer.tensors[name], tensor, rtol=0, atol=1e-10, msg=name)
    assert outer.metadata["fit"]["capture"] == "two-phase" and outer.metadata["fit"]["target_layout"] == "layer-outer"


@pytest.mark.parametrize(
    "changes, flag",
    [
        ({"statistics": StatisticsMode(passes=2, candidates=2, top_k_max=1)}, "--stats two-pass"),
        ({"weighting": "attention"}, "--weighting attention"),
        ({"map_kind": "mlp"}, "--map mlp"),
    ],
)
def test_what_needs_every_target_layer_at_once_is_refused_by_name(family, changes, flag):
    with pytest.raises(ConfigError, match=f"{flag} reads every target layer"):
        check_layer_outer(family[1].config, _options(**changes))
    config = make_model("qwen2").config
    config.model_type = "gemma"
    with pytest.raises(ConfigError, match="not 'gemma'"):
        check_layer_outer(config, _options())


def test_kvhub_fit_target_layout_layer_outer_gives_the_whole_target_mapper(tiny_model_dirs, text_corpus, tmp_path):
    from click.testing import CliRunner

    from kvhub.cli.main import main
    from kvhub.core.mapper import Mapper
    from tests.fixtures_fit import tiny_fit_args

    src, dst = tiny_model_dirs
    mappers = {}
    for layout in ("whole", "layer-outer"):
        out = tmp_path / layout
        args = tiny_fit_args(src, dst, calib=text_corpus, target_layout=layout, out=out, no_register=True)
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        mappers[layout] = Mapper.load(out)
    for name, tensor in mappers["whole"].tensors.items():
        torch.testing.assert_close(mappers["layer-outer"].tensors[name], tensor, rtol=0, atol=1e-10, msg=name)
    assert mappers["layer-outer"].metadata["fit"]["target_layout"] == "layer-outer"


def test_kill_9_between_two_layers_then_a_rerun_resumes_at_that_layer_and_gives_the_same_mapper(tmp_path, cache):
    """SIGKILL while layer 3 of 4 is swept (checkpoints after every layer): the rerun says it resumes after
    2 layers, sweeps only layers 3 and 4, and gives the uninterrupted mapper."""
    import os
    import signal
    import subprocess
    import sys

    checkpoint = tmp_path / "ckpt.safetensors"
    script = f"""
import os, signal, sys, torch
from tests.fitting.test_layer_outer import _run
def progress(description, completed, total):
    if description.startswith("target layer 3/4"):
        os.kill(os.getpid(), signal.SIGKILL)
_run({str(checkpoint)!r}, progress).save({str(tmp_path / "never")!r})
"""
    env = {**os.environ, "KVHUB_CACHE": str(cache)}
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=os.getcwd(), capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    (sweeps,) = (cache / "spool").glob("*/sweeps")
    assert sorted(p.name for p in sweeps.iterdir())[-1] == "sweeps.safetensors"
    seen, lines = [], []
    resumed = _run(checkpoint, lambda d, c, t: seen.append(d), notify=lines.append)
    assert lines == ["resuming the target's sweeps (2/4 layers done)"]
    assert {d.split(":")[0] for d in seen if d.startswith("target layer ")} == {"target layer 3/4", "target layer 4/4"}
    clean = _run(None)
    for name, tensor in clean.tensors.items():
        torch.testing.assert_close(resumed.tensors[name], tensor, rtol=0, atol=1e-10, msg=name)
    assert not list((cache / "spool").iterdir())


def _run(checkpoint, progress=None, notify=None):
    """The layer-outer fit of the tiny qwen2 pair (checkpointing every layer when ``checkpoint`` is set)."""
    options = _options(target_layout="layer-outer", checkpoint=checkpoint, checkpoint_every=1)
    return fit(*_family("qwen2"), source_id="s", target_id="d", options=options, progress=progress, notify=notify)
