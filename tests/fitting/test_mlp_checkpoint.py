"""The MLP checkpoint of ``kvhub fit --map mlp`` is read back checked: a finished layer whose recorded results are
not what training gives (NaN or text R^2, epochs past the schedule, a header nested past the JSON parser) is
trained again, never copied into mapper.json; and a fit that kept fewer than two rows of a split is refused
before its MLPs train (an R^2 over one row is undefined)."""

from __future__ import annotations

import json
import math
import shutil
import types

import pytest
import torch

from kvhub.errors import FitError
from kvhub.fitting import mlp_fit
from kvhub.fitting.options import FitOptions
from tests.core.test_mlp_map import _fit, nonlinear_pair

QUICK = dict(mlp_epochs=3, mlp_width=16)


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """(source, target, the uninterrupted fit, a folder holding the checkpoints of a fit stopped after
    target layer 0's MLPs were trained and checkpointed)."""
    source, target = nonlinear_pair()
    reference = _fit(source, target, **QUICK)
    folder = tmp_path_factory.mktemp("interrupted")
    original = mlp_fit._train

    def stop_at_layer_one(layer, kind, *args, **kwargs):
        if layer.target == 1:
            raise KeyboardInterrupt
        return original(layer, kind, *args, **kwargs)

    mlp_fit._train = stop_at_layer_one
    try:
        with pytest.raises(KeyboardInterrupt):
            _fit(source, target, checkpoint=folder / "job.safetensors", **QUICK)
    finally:
        mlp_fit._train = original
    assert mlp_fit.checkpoint_path(folder / "job.safetensors").is_file()
    return source, target, reference, folder


def _edit_results(path, change) -> None:
    """Rewrite the MLP checkpoint at ``path`` with change(results text) -> text in its header."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as handle:
        header = dict(handle.metadata())
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    header["results"] = change(header["results"])
    save_file(tensors, str(path), metadata=header)


def _set_field(name: str, value):
    def change(text: str) -> str:
        results = json.loads(text)
        results["k.0"][name] = value
        return json.dumps(results)

    return change


DAMAGED_RESULTS = [
    pytest.param(_set_field("heldout_r2", math.nan), id="r2-nan"),
    pytest.param(_set_field("heldout_r2", "high"), id="r2-text"),
    pytest.param(_set_field("ridge_heldout_r2", 7.5), id="ridge-r2-above-one"),
    pytest.param(_set_field("heldout_loss", -1.0), id="loss-negative"),
    pytest.param(_set_field("epochs", 10**30), id="epochs-huge"),
    pytest.param(_set_field("best_epoch", 99), id="best-epoch-past-epochs"),
    pytest.param(_set_field("epochs", True), id="epochs-bool"),
    pytest.param(lambda text: "[" * 5000 + "]" * 5000, id="nested-deep"),
    pytest.param(lambda text: json.dumps({"k.0": [], "v.0": []}), id="entries-lists"),
]


@pytest.mark.parametrize("change", DAMAGED_RESULTS)
def test_damaged_recorded_results_retrain_the_layer(change, interrupted, tmp_path, monkeypatch):
    """Planted bugs caught: `_restore` passing the recorded results to Trained as they are (a NaN R^2 registered
    a mapper every transfer of which failed; "high" ended the fit, after the work, in a TypeError; an epochs of
    10^30 reached mapper.json); a RecursionError of a deeply nested header escaping the checkpoint reader."""
    source, target, reference, folder = interrupted
    for path in folder.iterdir():
        shutil.copy(path, tmp_path / path.name)
    checkpoint = tmp_path / "job.safetensors"
    _edit_results(mlp_fit.checkpoint_path(checkpoint), change)
    trained, original = [], mlp_fit._train

    def counting(layer, kind, *args, **kwargs):
        trained.append((layer.target, kind))
        return original(layer, kind, *args, **kwargs)

    monkeypatch.setattr(mlp_fit, "_train", counting)
    resumed = _fit(source, target, checkpoint=checkpoint, **QUICK)
    assert (0, "k") in trained  # layer 0 trained again, not taken from the damaged checkpoint
    assert resumed.layers == reference.layers
    for name, tensor in reference.tensors.items():
        assert torch.equal(resumed.tensors[name], tensor), name


def test_a_split_of_fewer_than_two_rows_is_refused_before_training():
    """Planted bug caught: an MLP fit scoring its held-out R^2 over one row (-2e28 printed and recorded)."""
    one_row = types.SimpleNamespace(size=1)
    enough = types.SimpleNamespace(size=64)
    with pytest.raises(FitError, match="kept 1 heldout row.*at least 2 rows per split"):
        mlp_fit.train_maps(None, {"train": enough, "heldout": one_row}, None, FitOptions(map_kind="mlp"), job="j")
