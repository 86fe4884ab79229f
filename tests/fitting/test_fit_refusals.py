"""A Python caller of ``kvhub.fitting.job.fit_by_names`` gets the early refusals ``kvhub fit`` gives: each is
raised before any model loads (the models here are config-only directories whose loading fails the test).
Planted bugs caught: a refusal left in the CLI (the Python fit goes on to load the models: AssertionError);
a refusal that needs the store run without one; the launch of torchrun reached from the library."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvhub.errors import ConfigError, FitError, UnknownCalibrationError
from kvhub.fitting.job import FitRequest, check_request, fit_by_names
from kvhub.fitting.options import FitOptions
from tests.fixtures_calib import config_only_model
from tests.fixtures_store import make_store_artifact


@pytest.fixture
def models(tmp_path, monkeypatch) -> tuple[Path, Path]:
    monkeypatch.setenv("KVHUB_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KVHUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("KVHUB_DB_URL", raising=False)
    return config_only_model(tmp_path / "src", monkeypatch), config_only_model(tmp_path / "dst", monkeypatch)


def _notes(path: Path, word: str = "alpha") -> Path:
    path.write_text("\n\n".join(f"{word}{i} " * 40 for i in range(60)), encoding="utf-8")
    return path


def _request(models, tmp_path, **changes) -> FitRequest:
    src, dst = models
    fields = dict(
        src=str(src),
        dst=str(dst),
        calib=str(_notes(tmp_path / "notes.txt")),
        samples=8,
        seq_len=32,
        dtype="float32",
        device="cpu",
        options=FitOptions(stride=1),
    )
    return FitRequest(**{**fields, **changes})


@pytest.mark.parametrize(
    "changes,error,says",
    [
        ({"device": "h100"}, ConfigError, "not a torch device"),
        ({"device": "quantum"}, ConfigError, "'quantum' is not a device"),
        ({"calib": "legal-doc"}, UnknownCalibrationError, "did you mean 'legal-docs'"),
        ({"options": FitOptions(stride=1, top_k=3)}, ConfigError, "--k 1..2"),
        ({"samples": 1, "seq_len": 8}, FitError, "observations"),
        ({"name": "legal-docs"}, ConfigError, "built-in calibration set"),
        ({"name": "a:b"}, ConfigError, "cannot name a calibration set"),
    ],
    ids=["plan-profile", "no-device", "unknown-set", "k-above-layers", "too-few-rows", "built-in-name", "bad-name"],
)
def test_python_fit_refuses_what_the_cli_refuses(models, tmp_path, changes, error, says):
    with pytest.raises(error) as refused:
        fit_by_names(_request(models, tmp_path, **changes))
    assert says in str(refused.value)


def test_python_fit_refuses_a_series_holding_another_text(models, tmp_path):
    """With the store it will register in, the fit refuses a series fitted on another text; without one,
    nothing to clash with, it goes on to load the models."""
    from kvhub.models.loading import registered_model_id
    from kvhub.store import open_store

    src, dst = (registered_model_id(str(m)) for m in models)
    artifact = make_store_artifact(tmp_path / "v1", source=src, target=dst, calibration="notes")
    metadata = json.loads((artifact / "mapper.json").read_text())
    metadata["calibration"]["corpus_hash"] = "a" * 64
    (artifact / "mapper.json").write_text(json.dumps(metadata))
    request = _request(models, tmp_path, name="notes")
    with open_store() as store:
        store.register(artifact)
        with pytest.raises(ConfigError, match="another text"):
            check_request(request, store=store)
        with pytest.raises(ConfigError, match="another text"):
            fit_by_names(request, store=store)
    with pytest.raises(AssertionError, match="model was loaded"):
        fit_by_names(request)


def test_refusals_pass_a_good_request_through_to_the_model_load(models, tmp_path):
    with pytest.raises(AssertionError, match="model was loaded"):
        fit_by_names(_request(models, tmp_path, name="fresh-notes"))


def test_the_torchrun_command_line_drops_distributed():
    from kvhub.fitting.torchrun import torchrun_command

    command = torchrun_command(2, ["fit", "--src", "a", "--distributed", "2", "--dst", "b", "--distributed=3"])
    assert command[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m"]
    assert command[6:] == ["kvhub", "fit", "--src", "a", "--dst", "b"]


def test_the_old_check_device_name_says_what_replaced_it():
    import kvhub.fitting.job as job
    from kvhub.dtypes import check_device

    with pytest.warns(DeprecationWarning, match="kvhub.dtypes.check_device"):
        assert job.check_device is check_device
