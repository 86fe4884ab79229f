"""``kvhub fit --map mlp``: the ridge map plus a residual MLP per target layer and K/V.

Known answer: a tiny pair whose target K/V are a known nonlinear function of the source's (the target is the
source with f(z) = z + z^2 / 2 after its k and v projections, attention outputs zero in both so the hidden
states agree): the MLP map reaches a far higher held-out R^2 than ridge there, and on an exact linear family
it is never worse than ridge.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from kvhub.artifact import read_artifact
from kvhub.core.capture import run_model
from kvhub.core.control import control_mapper
from kvhub.core.mapper import Mapper
from kvhub.core.rope import Rotary, strip_rope
from kvhub.errors import ConfigError, FormatVersionError
from kvhub.fitting import mlp_fit
from kvhub.fitting.options import FitOptions
from tests.tinymodels import exact_family_target, make_model
from tests.fixtures_fit import fit_tiny, tiny_fit_args, token_ids as _ids
from tests.fixtures_store import load_with_old_kvhub

MLP = dict(map_kind="mlp", mlp_width=64, mlp_depth=2, mlp_tokens=2048, mlp_epochs=40)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: these tiny GEMMs only lose from a second one, and the results stay the same on
    every machine this runs on (the MLPs are deterministic for one thread count)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Bend(torch.nn.Module):
    """f(z) = z + z^2 / 2, elementwise: what the target puts after its k and v projections."""

    def forward(self, z):
        return z + z * z / 2


def nonlinear_pair(layers: int = 2):
    """(source, target): target K~/V = f(source K~/V) exactly, f = :class:`Bend` (module docstring)."""
    source = make_model("qwen2", num_hidden_layers=layers, seed=5)
    for layer in source.model.layers:
        torch.nn.init.zeros_(layer.self_attn.o_proj.weight)  # attention adds nothing: both share hidden states
    target = copy.deepcopy(source)
    for layer in target.model.layers:
        attention = layer.self_attn
        attention.k_proj = torch.nn.Sequential(attention.k_proj, Bend())
        attention.v_proj = torch.nn.Sequential(attention.v_proj, Bend())
    return source, target


def _fit(source, target, *, checkpoint=None, **options):
    return fit_tiny(source, target, train=(32, 64), heldout=(8, 64), checkpoint=checkpoint, **{**MLP, **options})


@pytest.fixture(scope="module")
def bent():
    source, target = nonlinear_pair()
    return source, target, _fit(source, target)


def test_known_answer_mlp_beats_ridge_on_a_nonlinear_target(bent):
    _, _, mapper = bent
    metrics = mapper.metadata["metrics"]
    for kind in "kv":
        mlp, ridge = metrics[f"heldout_r2_{kind}_mean"], metrics[f"ridge_heldout_r2_{kind}_mean"]
        print(f"{kind}: held-out R^2 ridge {ridge:.4f}, mlp {mlp:.4f}")
        assert ridge < 0.9 and mlp > 0.97 and mlp - ridge > 0.1
        for layer in mapper.layers:
            assert layer[f"r2_{kind}"] > layer[f"ridge_r2_{kind}"] and layer[f"mlp_best_epoch_{kind}"] > 0
    assert mapper.metadata["kind"] == "mlp" and mapper.metadata["mlp"]["width"] == 64
    assert len(mapper.metadata["mlp"]["losses"]["k"]["heldout"]) == len(mapper.layers)


def _target_rows(model, ids, m):
    """Target layer m's RoPE-stripped keys and values of ``ids`` as (B, T, H*D) rows."""
    cache = run_model(model, ids)
    rotary = Rotary.from_model(model)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    keys = strip_rope(cache.layers[m].keys.float(), *rotary.cos_sin(positions, m))
    return [t.transpose(1, 2).flatten(2) for t in (keys, cache.layers[m].values)]


def _mapped_rows(mapper, source, ids, m):
    cache = mapper.transfer(run_model(source, ids), dtype=torch.float32)
    rotary = Rotary.from_config(mapper._config("target"))
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    keys = strip_rope(cache.layers[m].keys, *rotary.cos_sin(positions, m))
    return [t.transpose(1, 2).flatten(2) for t in (keys, cache.layers[m].values)]


def _r2(predicted, actual):
    return 1 - float((actual - predicted).square().sum() / (actual - actual.mean((0, 1))).square().sum())


def test_artifact_round_trip_and_transfer_applies_the_mlp(bent, tmp_path):
    source, target, mapper = bent
    directory = mapper.save(tmp_path / "mlp")
    metadata = read_artifact(directory)
    assert metadata["format_version"] == 4 and metadata["kind"] == "mlp"
    loaded = Mapper.load(directory, deshrink="off")
    assert loaded.kind.name == "mlp" and "k.1.mlp.2.weight" in loaded.tensors
    ids = _ids(2, 40, 9)
    ridge_only = Mapper(
        {n: t for n, t in loaded.tensors.items() if ".mlp." not in n},
        {**loaded.metadata, "kind": "ridge"},
        deshrink="off",
    )
    for m in range(2):
        own = _target_rows(target, ids, m)
        with_mlp, ridge = _mapped_rows(loaded, source, ids, m), _mapped_rows(ridge_only, source, ids, m)
        for got, plain, want in zip(with_mlp, ridge, own):  # keys, values: out of sample, through transfer
            assert _r2(got, want) > 0.97 and _r2(got, want) > _r2(plain, want) + 0.05


def test_deshrink_scales_the_mlp_term_too(bent):
    _, _, mapper = bent
    keys = [torch.randn(1, 2, 5, 16) for _ in range(2)]
    values = [torch.randn(1, 2, 5, 16) for _ in range(2)]
    positions = torch.arange(5)[None]
    plain = mapper.deshrunk("off").map_layers(keys, values, positions, dtype=torch.float32)
    shrunk = mapper.deshrunk("v").map_layers(keys, values, positions, dtype=torch.float32)
    for layer, (_, v_plain), (_, v_shrunk) in zip(mapper.layers, plain, shrunk):
        mean = mapper.tensors[f"v.{layer['target']}.target_mean"].view(1, 2, 1, 16)
        scale = 1 / max(layer["r2_v"], 0.25) ** 0.5
        torch.testing.assert_close(v_shrunk, mean + (v_plain - mean) * scale, rtol=1e-4, atol=1e-4)


def test_control_of_an_mlp_mapper_is_the_mean(bent):
    source, _, mapper = bent
    control = control_mapper(mapper)
    assert control.kind.name == "ridge" and "mlp" not in control.metadata
    cache = control.transfer(run_model(source, _ids(1, 6, 3)), dtype=torch.float32)
    assert torch.allclose(cache.layers[0].values[0, :, 0].flatten(), mapper.tensors["v.0.target_mean"], atol=1e-5)


def test_on_an_exact_linear_family_the_mlp_is_no_worse_than_ridge():
    source = make_model("qwen2", num_hidden_layers=2)
    target, _ = exact_family_target(source, insert_before=(1,), kv_repeat=2, double_head_dim=True)
    mapper = _fit(source, target, mlp_epochs=5, ridge_lambda=1e-9)
    for layer in mapper.layers:
        for kind in "kv":
            assert layer[f"r2_{kind}"] >= layer[f"ridge_r2_{kind}"] - 1e-9
            assert layer[f"ridge_r2_{kind}"] > 0.999


def test_training_is_deterministic_and_resumes_after_the_last_finished_layer(tmp_path, monkeypatch):
    source, target = nonlinear_pair()
    quick = dict(mlp_epochs=3, mlp_width=16)
    reference = _fit(source, target, **quick)
    trained, original, stopped = [], mlp_fit._train, []

    def stop_at_layer_one(layer, kind, *args, **kwargs):
        if layer.target == 1 and not stopped:
            stopped.append(True)
            raise KeyboardInterrupt
        trained.append((layer.target, kind))
        return original(layer, kind, *args, **kwargs)

    monkeypatch.setattr(mlp_fit, "_train", stop_at_layer_one)
    checkpoint = tmp_path / "job.safetensors"
    with pytest.raises(KeyboardInterrupt):
        _fit(source, target, checkpoint=checkpoint, **quick)
    assert trained == [(0, "k"), (0, "v")] and mlp_fit.checkpoint_path(checkpoint).is_file()
    resumed = _fit(source, target, checkpoint=checkpoint, **quick)
    assert trained == [(0, "k"), (0, "v"), (1, "k"), (1, "v")]  # layer 0 came from the checkpoint
    assert resumed.tensors.keys() == reference.tensors.keys()
    for name, tensor in reference.tensors.items():
        assert torch.equal(resumed.tensors[name], tensor), name
    assert resumed.layers == reference.layers


def test_compressed_maps_take_a_residual_mlp(tmp_path):
    source, target = nonlinear_pair()
    mapper = _fit(source, target, rank=8, mlp_epochs=3, mlp_width=16)
    assert "k.0.weight_a" in mapper.tensors and "k.0.mlp.0.weight" in mapper.tensors
    loaded = Mapper.load(mapper.save(tmp_path / "m"))
    assert loaded.metadata["structure"]["rank"] == 8 and loaded.metadata["format_version"] == 4
    loaded.transfer(run_model(source, _ids(1, 8, 2)))


def test_refusals_before_any_forward_pass():
    options = FitOptions(map_kind="mlp")
    with pytest.raises(ConfigError, match="distributed"):
        mlp_fit.check_options(options, heldout_sequences=4, distributed=True)
    with pytest.raises(ConfigError, match="held-out"):
        mlp_fit.check_options(options, heldout_sequences=0)
    with pytest.raises(ConfigError, match="tree.*--map|--map.*tree"):
        FitOptions(map_kind="tree")


def test_an_unknown_kind_or_a_newer_format_is_refused_by_name(bent, tmp_path):
    _, _, mapper = bent
    directory = mapper.save(tmp_path / "m")
    path = directory / "mapper.json"
    metadata = json.loads(path.read_text())
    path.write_text(json.dumps({**metadata, "kind": "tree"}))
    with pytest.raises(FormatVersionError, match="kind 'tree'.*upgrade"):
        Mapper.load(directory)
    path.write_text(json.dumps({**metadata, "format_version": 9, "kind": "tree"}))
    with pytest.raises(FormatVersionError, match="version 9 \\(a map of kind 'tree'\\).*upgrade"):
        Mapper.load(directory)
    path.write_text(json.dumps({**metadata, "mlp": {**metadata["mlp"], "depth": 3}}))
    with pytest.raises(Exception, match="mlp"):
        Mapper.load(directory)


def test_the_card_names_the_kind_and_the_mlp(bent, tmp_path):
    from kvhub.hub.card import model_card, read_front_matter

    _, _, mapper = bent
    metadata = read_artifact(mapper.save(tmp_path / "m"))
    card = model_card(metadata, repo_id="acme/kvmap", version_tag="v1")
    assert read_front_matter(card)["kvhub"]["map"] == {"kind": "mlp", "width": 64, "depth": 2, "activation": "gelu"}
    assert "residual MLP (2 x 64, gelu)" in card and "ridge + residual MLP (2 x 64, gelu)" in card


def test_cli_fit_map_mlp_registers_the_kind_and_refuses_distributed(
    tiny_model_dirs, tmp_path, monkeypatch, text_corpus
):
    from click.testing import CliRunner

    from kvhub.cli.main import main
    from kvhub.store import open_store

    monkeypatch.setenv("KVHUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KVHUB_HOME", str(tmp_path / "home"))
    db = f"sqlite:///{tmp_path / 'store.db'}"
    src, dst = tiny_model_dirs
    args = tiny_fit_args(src, dst, calib=text_corpus, db=db, map="mlp", mlp_width=8, mlp_epochs=2)
    refused = CliRunner().invoke(main, [*args, "--distributed", "2"])
    assert refused.exit_code != 0 and "does not run distributed" in refused.output
    result = CliRunner().invoke(main, [*args, "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["kind"] == "mlp" and "ridge_heldout_r2_k_mean" in summary["metrics"]
    with open_store(db) as store:
        [version] = store.versions()
        assert (version.map_kind, version.mlp_width, version.mlp_depth) == ("mlp", 8, 2)


PREVIOUS_RELEASE = "e3b7815"  # the last commit before map kinds: reads format versions up to 3


@pytest.mark.slow
def test_the_previous_release_refuses_an_mlp_artifact_with_upgrade(bent, tmp_path):
    done = load_with_old_kvhub(PREVIOUS_RELEASE, bent[2].save(tmp_path / "m"), tmp_path)
    assert done.returncode != 0
    assert "FormatVersionError" in done.stderr and "format version 4" in done.stderr and "upgrade" in done.stderr


def test_handoff_and_the_connectors_in_place_path_apply_the_mlp(bent):
    from kvhub.serving.handoff import handoff

    source, target, mapper = bent
    keys = [torch.randn(1, 2, 6, 16) for _ in range(2)]
    values = [torch.randn(1, 2, 6, 16) for _ in range(2)]
    positions = torch.arange(6)[None]
    fresh = mapper.map_layers(keys, values, positions, dtype=torch.float32)
    out = [(torch.empty(1, 2, 4, 16), torch.empty(1, 2, 4, 16)) for _ in mapper.layers]
    mapper.map_layers(keys, values, positions, out=out)  # what the vLLM connector calls
    for (k, v), (k_out, v_out) in zip(fresh, out):
        torch.testing.assert_close(k_out, k[:, :, 2:], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v_out, v[:, :, 2:], rtol=1e-5, atol=1e-5)
    ids = _ids(1, 12, 4)
    generated = handoff(mapper, source, target, ids, max_new_tokens=3, do_sample=False)
    assert generated.shape == (1, 15)
