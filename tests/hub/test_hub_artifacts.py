"""The artifact format through the Hub: every map structure pushed, pulled and used from the pulled copy;
crafted repositories refused by `kvhub pull` (exit code, nothing registered, the download purged); a
malicious card skipped by `kvhub search`.  Against the local Hub server (tests/hub_server.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvhub.artifact import sha256_file
from kvhub.artifact.metadata import FORMAT_VERSION
from kvhub.core.mapper import Mapper
from kvhub.store import open_store
from tests.fixtures_hub import run
from tests.fixtures_store import make_store_artifact
from tests.contracts.test_bad_inputs import assert_clean_exit

pytestmark = pytest.mark.hub

STRUCTURES = {  # name: (head groups, rank); the tiny pair: source width 2 x 8, target 2 x 16, k = 1
    "dense": (1, None),
    "head-local": (2, None),
    "low-rank": (1, 4),
    "head-local-low-rank": (2, 4),
}


def structured_artifact(directory, *, groups: int, rank: int | None, seed: int):
    """The store tests' tiny mapper with its maps replaced by random maps of the given structure (and the
    optional target means), saved as an artifact."""
    base = Mapper.load(make_store_artifact(directory.parent / f"{directory.name}-base", seed=seed))
    generator = torch.Generator().manual_seed(seed)
    d_in, d_out = 16, 32
    lead = (groups,) if groups > 1 else ()
    tensors = {}
    for name in base.tensors:
        if not name.endswith(".bias"):
            continue
        prefix = name[: -len(".bias")]
        tensors[name] = torch.randn(d_out, generator=generator)
        tensors[f"{prefix}.target_mean"] = torch.randn(d_out, generator=generator)
        if rank is None:
            tensors[f"{prefix}.weight"] = torch.randn(*lead, d_in // groups, d_out // groups, generator=generator)
        else:
            tensors[f"{prefix}.weight_a"] = torch.randn(*lead, d_in // groups, rank, generator=generator)
            tensors[f"{prefix}.weight_b"] = torch.randn(*lead, rank, d_out // groups, generator=generator)
    metadata = dict(base.metadata, structure={"head_groups": groups, "rank": rank})
    return Mapper(tensors, metadata).save(directory)


def _source_cache(seed: int = 0):
    from transformers import DynamicCache

    generator = torch.Generator().manual_seed(seed)
    cache = DynamicCache()
    for index in range(2):
        cache.update(torch.randn(2, 2, 6, 8, generator=generator), torch.randn(2, 2, 6, 8, generator=generator), index)
    return cache


@pytest.mark.parametrize("structure", list(STRUCTURES))
def test_every_structure_is_pushed_pulled_and_used_from_the_pulled_copy(structure, hub_env, db):
    groups, rank = STRUCTURES[structure]
    artifact = structured_artifact(hub_env.tmp / "m", groups=groups, rank=rank, seed=21)
    assert json.loads((artifact / "mapper.json").read_text())["format_version"] == 3  # target_mean stored
    assert run("import", str(artifact), "--db", db).exit_code == 0
    ref = "tiny-coder-0.5b-instruct:tiny-coder-1.5b-instruct@v1"
    pushed = run("push", ref, "--repo", f"alice/kv-{structure}", "--db", db)
    assert pushed.exit_code == 0, pushed.output
    other = str(hub_env.tmp / "other.db")
    pulled = run("pull", f"alice/kv-{structure}@v1", "--db", other)
    assert pulled.exit_code == 0, pulled.output
    with open_store(other) as store:
        copy = Mapper.load(store.artifact_path(store.resolve(ref)))
    assert copy.metadata["tensors"]["sha256"] == sha256_file(artifact / "mapper.safetensors")
    cache = _source_cache()
    for got, want in zip(copy.transfer(cache).layers, Mapper.load(artifact).transfer(cache).layers):
        assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)


# ---- crafted repositories ----------------------------------------------------------------------------
def publish_raw(server, repo_id: str, files: dict[str, bytes]) -> None:
    """Commit ``files`` (any names, any bytes) to main of ``repo_id`` on the test server, bypassing every
    check kvhub and huggingface_hub make on upload: what a malicious publisher controls."""
    state = server.state
    with state.lock:
        repo = state.repos.get(repo_id) or state.create_repo(repo_id, repo_id.split("/")[0], False)
        parent = repo["branches"]["main"]
        tree = dict(repo["commits"][parent]["tree"])
        tree.update({name: state.put_blob(data) for name, data in files.items()})
        repo["branches"]["main"] = state.new_commit(repo, parent, tree, "crafted", "", repo["owner"])
        state.save()


@pytest.fixture(scope="module")
def good_files(tmp_path_factory) -> dict[str, bytes]:
    directory = make_store_artifact(tmp_path_factory.mktemp("hub-good") / "m", seed=31)
    return {name: (directory / name).read_bytes() for name in ("mapper.json", "mapper.safetensors")}


def _json_edit(change):
    def craft(files):
        metadata = json.loads(files["mapper.json"])
        replaced = change(metadata)
        return {**files, "mapper.json": json.dumps(metadata if replaced is None else replaced).encode()}

    return craft


def _nan_weights(files):
    import hashlib

    from safetensors.torch import load, save

    tensors = load(files["mapper.safetensors"])
    tensors["k.0.weight"][0, 0] = math.nan
    data = save(tensors)
    metadata = json.loads(files["mapper.json"])
    metadata["tensors"]["sha256"] = hashlib.sha256(data).hexdigest()
    return {"mapper.json": json.dumps(metadata).encode(), "mapper.safetensors": data}


# (id, craft(files) -> files, exit code, words)
HUB_CASES = [
    ("metadata-list", lambda f: {**f, "mapper.json": b"[]"}, 5, "must be a JSON object"),
    ("metadata-null", lambda f: {**f, "mapper.json": b"null"}, 5, "must be a JSON object"),
    ("metadata-not-utf8", lambda f: {**f, "mapper.json": b'{"a": "\xff"}'}, 5, "not UTF-8"),
    ("tensors-string", _json_edit(lambda m: m.update(tensors="x")), 5, "`tensors` must be a JSON object"),
    ("layer-index-string", _json_edit(lambda m: m["layers"][0].update(target="0")), 5, "`layers[0].target`"),
    (
        "layers-reversed-and-duplicated",
        _json_edit(lambda m: m["layers"].__setitem__(2, m["layers"][0])),
        5,
        "repeats target layer 0",
    ),
    (
        "tensors-file-parent",
        _json_edit(lambda m: m["tensors"].update(file="../mapper.safetensors")),
        5,
        "plain file name",
    ),
    ("config-edited", _json_edit(lambda m: m["target"]["config"].update(rope_theta=1.0)), 5, "config_hash"),
    ("format-newer", _json_edit(lambda m: m.update(format_version=FORMAT_VERSION + 1)), 5, "upgrade"),
    ("nan-weights", _nan_weights, 5, "NaN or Inf"),
    ("no-metadata", lambda f: {"mapper.safetensors": f["mapper.safetensors"]}, 12, "not a kvhub mapper repository"),
    ("figure-name-escapes", lambda f: {**f, "../../escape.png": b"x"}, 10, "huggingface_hub refused"),
    ("figure-name-absolute", lambda f: {**f, "/tmp/absolute.png": b"x"}, 10, "huggingface_hub refused"),
]


@pytest.mark.parametrize("case_id, craft, code, words", HUB_CASES, ids=[c[0] for c in HUB_CASES])
def test_pull_refuses_a_crafted_repository(case_id, craft, code, words, good_files, hub_env, db):
    repo_id = f"alice/crafted-{case_id}"
    publish_raw(hub_env.server, repo_id, craft(dict(good_files)))
    result = run("pull", repo_id, "--db", db)
    assert_clean_exit(result, code, words)
    with open_store(db) as store:
        assert store.versions() == [] and not any((store.artifacts_dir / "sha256").rglob("*"))
    if code == 5 and words != "upgrade":  # bad bytes are dropped from the cache, so the next pull fetches anew
        assert not list(hub_env.cache.glob(f"models--alice--crafted-{case_id}/snapshots/*"))
    assert not (hub_env.tmp.parent / "escape.png").exists() and not (hub_env.tmp / "escape.png").exists()


def test_search_skips_a_malicious_card_and_lists_the_rest(good_files, hub_env, db, caplog):
    assert (
        run("import", str(structured_artifact(hub_env.tmp / "m", groups=1, rank=None, seed=41)), "--db", db).exit_code
        == 0
    )
    assert (
        run(
            "push", "tiny-coder-0.5b-instruct:tiny-coder-1.5b-instruct@v1", "--repo", "alice/kv-good", "--db", db
        ).exit_code
        == 0
    )
    for name, block in (
        ("string", '"not a block"'),
        ("metrics-list", "{metrics: [1, 2], version: v1}"),
        ("source-number", "{source: {model_id: 5}}"),
    ):
        card = f"---\nlibrary_name: kvhub\nbase_model: [a/src, a/dst]\nkvhub: {block}\n---\n# crafted\n"
        publish_raw(hub_env.server, f"alice/kv-bad-{name}", {**good_files, "README.md": card.encode()})
    result = run("search", "--json")
    assert_clean_exit(result, 0)
    assert [m["repo_id"] for m in json.loads(result.stdout)] == ["alice/kv-good"]
    assert sum("skipping alice/kv-bad-" in r.getMessage() for r in caplog.records) == 3


def test_pull_warns_when_the_card_describes_other_weights(hub_env, db, caplog):
    """mapper.json and the tensors swapped together stay a valid artifact (kvhub trusts the verified
    mapper.json); the stale card that still names the old sha256 is reported."""
    assert run("import", str(make_store_artifact(hub_env.tmp / "a", seed=61)), "--db", db).exit_code == 0
    assert (
        run(
            "push", "tiny-coder-0.5b-instruct:tiny-coder-1.5b-instruct@v1", "--repo", "alice/kv-swap", "--db", db
        ).exit_code
        == 0
    )
    other = make_store_artifact(hub_env.tmp / "b", seed=62)
    publish_raw(
        hub_env.server,
        "alice/kv-swap",
        {name: (other / name).read_bytes() for name in ("mapper.json", "mapper.safetensors")},
    )
    pulled = run("pull", "alice/kv-swap", "--db", str(hub_env.tmp / "other.db"))
    assert_clean_exit(pulled, 0)
    assert any("README.md describes tensors" in r.getMessage() for r in caplog.records)
