"""The models a cascade serves must be the ones its mapper was fitted on: `kvhub serve --small-model /
--large-model` of another KV geometry is refused before any server starts, naming both models, and
`kvhub.load(SRC, DST, hub_repo=...)` refuses a repository whose mapper maps other models."""

from __future__ import annotations

import json

import pytest

from kvhub.errors import IncompatibleError
from tests.fixtures_store import DST_ID, SRC_ID, store_fingerprint
from tests.serving.test_serve import _invoke, _serve_args, fake_vllm, mapper_db  # noqa: F401  (fixtures)


def _model_dir(path, model_id: str, **changes):
    """A model folder holding only the config.json of ``model_id``'s fingerprint, with ``changes``."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({**store_fingerprint(model_id)["config"], **changes}))
    return str(path)


@pytest.mark.parametrize("role", ["small", "large"])
def test_a_served_model_of_another_geometry_is_refused_naming_both(mapper_db, tmp_path, fake_vllm, role):  # noqa: F811
    """Planted bugs caught: --small-model / --large-model taken on trust (the large engine refused the mapper
    minutes later, every request then prefilled; a small model of other KV stored caches no map reads);
    only one side checked; a message naming only one of the two models."""
    fitted = SRC_ID if role == "small" else DST_ID
    other = _model_dir(tmp_path / "other", fitted, num_hidden_layers=7)
    result = _invoke(*_serve_args(mapper_db, tmp_path, fake_vllm, [8001, 8002], f"--{role}-model", other, "--dry-run"))
    assert result.exit_code == IncompatibleError.exit_code, result.output
    said = " ".join(result.stderr.split())
    assert f"--{role}-model {other}" in said and "7 layers" in said and f"{fitted} has" in said


def test_served_models_of_the_mapper_s_geometry_or_without_a_config_pass(mapper_db, tmp_path, fake_vllm):  # noqa: F811
    same = _model_dir(tmp_path / "same", SRC_ID)
    result = _invoke(
        *_serve_args(
            mapper_db,
            tmp_path,
            fake_vllm,
            [8001, 8002],
            "--small-model",
            same,
            "--large-model",
            "acme/unfetched",
            "--dry-run",
            "--kv-cache-gib",
            "2",
        )
    )
    assert result.exit_code == 0, result.output


@pytest.mark.hub
def test_load_refuses_a_hub_repository_whose_mapper_maps_other_models(hub_env, db):
    """kvhub.load(SRC, DST, hub_repo=...) of a repository holding a mapper of other models: IncompatibleError
    naming what it maps and what was asked, nothing registered."""
    import kvhub
    from kvhub.store import open_store
    from tests.fixtures_hub import register, run

    version = register(db, hub_env.tmp / "a1", seed=1)
    assert run("push", version.ref, "--repo", "alice/kvmap", "--db", db).exit_code == 0
    elsewhere = str(hub_env.tmp / "elsewhere.db")
    with pytest.raises(IncompatibleError) as refused:
        kvhub.load("Qwen/Qwen2.5-Coder-0.5B-Instruct", DST_ID, hub_repo="alice/kvmap", db=elsewhere)
    message = str(refused.value)
    assert f"maps {SRC_ID} -> {DST_ID}" in message and "Qwen/Qwen2.5-Coder-0.5B-Instruct" in message
    with open_store(elsewhere) as store:
        assert store.versions() == []
