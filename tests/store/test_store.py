"""The store on SQLite and PostgreSQL: registering, references, aliases, removal, gc, integrity."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvhub.errors import (
    AmbiguousError,
    ArtifactError,
    ConfigError,
    IntegrityError,
    NonFiniteError,
    NotFoundError,
    StoreError,
)
from kvhub.store import Ref, open_store
from tests.fixtures_store import DST_ID, SRC_ID

PAIR = "tiny-coder-0.5b-instruct:tiny-coder-1.5b-instruct"


def _object_dirs(store) -> list[Path]:
    return sorted(p for p in (store.artifacts_dir / "sha256").glob("*/*"))


# ---- registering ---------------------------------------------------------------------------------
def test_register_records_everything_from_mapper_json(store, artifact_factory):
    artifact = artifact_factory(seed=1)
    version = store.register(artifact, lineage={"command": "kvhub fit --k 1"})
    assert (version.source, version.target, version.calibration, version.version) == (SRC_ID, DST_ID, "legal-docs", 1)
    assert version.aliases == ("latest",)
    assert version.k == 1 and version.ridge_lambda == pytest.approx(0.1)
    assert [layer["target"] for layer in version.selected_layers] == [0, 1, 2]
    assert version.family == "qwen2" and version.status == "ready"
    metadata = json.loads((artifact / "mapper.json").read_text())
    assert version.tensors_sha256 == metadata["tensors"]["sha256"]
    described = store.describe(version)
    assert described["lineage"] == {"command": "kvhub fit --k 1"}
    assert described["source_model"]["num_kv_heads"] == 2 and described["target_model"]["num_layers"] == 3
    assert described["calibration_set"]["tokens"] == 4096
    metrics = {(m["name"], m["layer"]): m["value"] for m in described["metrics"]}
    assert metrics[("heldout_r2_k_mean", None)] == pytest.approx(0.89)
    assert metrics[("r2_v", 2)] == pytest.approx(0.78)
    stored = store.artifact_path(version)
    assert stored.is_relative_to(store.artifacts_dir)
    assert (stored / "mapper.json").read_bytes() == (artifact / "mapper.json").read_bytes()


def test_versions_are_monotonic_and_never_reused(store, artifact_factory):
    numbers = [store.register(artifact_factory(seed=seed)).version for seed in range(3)]
    assert numbers == [1, 2, 3]
    store.remove(f"{PAIR}@v3")
    assert store.resolve(f"{PAIR}@latest").version == 2
    assert store.register(artifact_factory(seed=10)).version == 4
    with pytest.raises(NotFoundError, match="v3"):
        store.resolve(f"{PAIR}@v3")


def test_registering_the_same_artifact_twice_returns_the_same_version(store, artifact_factory):
    artifact = artifact_factory(seed=2)
    first = store.register(artifact)
    again = store.register(artifact)
    assert again.id == first.id and [v.version for v in store.versions()] == [1]


def test_a_corrupt_artifact_is_refused_and_nothing_is_stored(store, artifact_factory):
    artifact = artifact_factory(seed=3)
    tensors = artifact / "mapper.safetensors"
    data = bytearray(tensors.read_bytes())
    data[-1] ^= 0xFF
    tensors.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="sha256"):
        store.register(artifact)
    assert store.versions() == [] and _object_dirs(store) == []
    assert list((store.artifacts_dir / ".tmp").iterdir()) == []


def test_an_artifact_of_an_unknown_format_is_refused(store, artifact_factory):
    artifact = artifact_factory(seed=4)
    metadata = json.loads((artifact / "mapper.json").read_text())
    metadata["format_version"] = 99
    (artifact / "mapper.json").write_text(json.dumps(metadata))
    with pytest.raises(ArtifactError, match="format version 99"):
        store.register(artifact)
    with pytest.raises(ArtifactError, match="mapper.json is missing"):
        store.register(artifact.parent / "does-not-exist")


def test_store_reads_the_format_the_mapper_writes():
    from kvhub.core import mapper
    from kvhub.store import ingest

    assert mapper.FORMAT_VERSION in ingest.SUPPORTED_FORMAT_VERSIONS
    assert mapper.METADATA_FILE == ingest.METADATA_FILE


def test_versions_are_immutable(store, artifact_factory):
    from sqlalchemy.orm import Session

    from kvhub.store.tables import VersionRow

    version = store.register(artifact_factory(seed=5))
    with Session(store._engine) as session:
        row = session.get(VersionRow, version.id)
        row.k = 7
        with pytest.raises(StoreError, match="immutable"):
            session.flush()


# ---- references ----------------------------------------------------------------------------------
def test_references_accept_full_ids_short_names_and_selectors(store, artifact_factory):
    store.register(artifact_factory(seed=1))
    second = store.register(artifact_factory(seed=2))
    for ref in (
        f"{SRC_ID}:{DST_ID}:legal-docs@v2",
        f"{PAIR}:legal-docs@latest",
        PAIR.upper(),
        f"{SRC_ID.lower()}:{DST_ID}@2",
        f"{PAIR}:LEGAL-DOCS",
    ):
        assert store.resolve(ref).id == second.id, ref
    assert store.find(SRC_ID, "tiny-coder-1.5b-instruct", calibration="legal-docs", version="v1").version == 1
    assert store.reference(second) == "Tiny-Coder-0.5B-Instruct:Tiny-Coder-1.5B-Instruct:legal-docs@v2"


def test_ambiguous_short_names_list_the_candidates(store, artifact_factory):
    store.register(artifact_factory(seed=1))
    store.register(artifact_factory(seed=2, source="Acme/tiny-coder-0.5b-instruct"))
    with pytest.raises(AmbiguousError) as caught:
        store.resolve(PAIR)
    assert SRC_ID in str(caught.value) and "Acme/tiny-coder-0.5b-instruct" in str(caught.value)
    assert store.resolve(f"{SRC_ID}:{DST_ID}").source == SRC_ID  # the full id settles it
    assert store.reference(store.resolve(f"{SRC_ID}:{DST_ID}")).startswith(SRC_ID)


def test_several_calibration_sets_must_be_named(store, artifact_factory):
    store.register(artifact_factory(seed=1))
    store.register(artifact_factory(seed=2, calibration="chat"))
    with pytest.raises(AmbiguousError, match="chat, legal-docs"):
        store.resolve(PAIR)
    assert store.resolve(f"{PAIR}:chat").calibration == "chat"


def test_misses_say_what_exists(store, artifact_factory):
    with pytest.raises(NotFoundError, match="the store is empty"):
        store.resolve(PAIR)
    store.register(artifact_factory(seed=1))
    with pytest.raises(NotFoundError, match=f"sources in the store: {SRC_ID}"):
        store.resolve("nope:tiny-coder-1.5b-instruct")
    with pytest.raises(NotFoundError, match="calibration sets in the store: legal-docs"):
        store.resolve(f"{PAIR}:chat")
    with pytest.raises(NotFoundError, match="versions: v1"):
        store.resolve(f"{PAIR}@v9")
    with pytest.raises(NotFoundError, match="no alias 'staging'"):
        store.resolve(f"{PAIR}@staging")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("a:b:c@v3", Ref("a", "b", "c", 3)),
        ("a:b@production", Ref("a", "b", None, None, "production")),
        ("Org/A:Org/B:legal-docs", Ref("Org/A", "Org/B", "legal-docs")),
        ("/models/a@2024:b", Ref("/models/a@2024", "b")),
        (" a:b:c@7 ", Ref("a", "b", "c", 7)),
    ],
)
def test_reference_syntax(text, expected):
    assert Ref.parse(text) == expected
    assert Ref.parse(str(expected)) == expected


@pytest.mark.parametrize("text", ["a", "a:b:c:d", "a::c", "a:b@", "a:b@v0", "a:b@bad name"])
def test_malformed_references_are_config_errors(text):
    with pytest.raises(ConfigError):
        Ref.parse(text)


# ---- aliases -------------------------------------------------------------------------------------
def test_production_wins_over_latest_and_aliases_move(store, artifact_factory):
    first = store.register(artifact_factory(seed=1))
    store.register(artifact_factory(seed=2))
    assert store.resolve(PAIR).version == 2
    store.tag(f"{PAIR}@v1", "production")
    assert store.resolve(PAIR).id == first.id
    assert store.resolve(f"{PAIR}@latest").version == 2
    store.tag(f"{PAIR}@v2", "production")
    assert store.resolve(f"{PAIR}@production").version == 2
    assert store.resolve(f"{PAIR}@v1").aliases == ()
    assert set(store.resolve(f"{PAIR}@v2").aliases) == {"latest", "production"}


def test_untag_checks_the_version_when_one_is_named(store, artifact_factory):
    store.register(artifact_factory(seed=1))
    store.register(artifact_factory(seed=2))
    store.tag(f"{PAIR}@v1", "staging")
    with pytest.raises(ConfigError, match="points at v1, not v2"):
        store.untag(f"{PAIR}@v2", "staging")
    assert store.untag(f"{PAIR}@v1", "staging").version == 1
    store.tag(f"{PAIR}@v2", "staging")
    assert store.untag(PAIR, "staging").version == 2
    with pytest.raises(NotFoundError):
        store.resolve(f"{PAIR}@staging")


@pytest.mark.parametrize("alias", ["latest", "v3", "3", "bad alias", "-x"])
def test_reserved_and_malformed_aliases_are_refused(store, artifact_factory, alias):
    store.register(artifact_factory(seed=1))
    with pytest.raises(ConfigError):
        store.tag(PAIR, alias)


# ---- removal and gc ------------------------------------------------------------------------------
def test_rm_refuses_a_pinned_version_unless_forced(store, artifact_factory):
    store.register(artifact_factory(seed=1))
    second = store.register(artifact_factory(seed=2))
    store.tag(second, "production")
    with pytest.raises(StoreError, match="production"):
        store.remove(second)
    removed = store.remove(second, force=True)
    assert removed.version == 2
    assert store.resolve(PAIR).version == 1  # production went with it; latest moved back
    assert store.resolve(f"{PAIR}@v1").aliases == ("latest",)
    assert not (store.artifacts_dir / removed.artifact_location).exists()


def test_rm_keeps_an_artifact_another_version_shares(store, artifact_factory):
    artifact = artifact_factory(seed=1)
    shared = store.register(artifact)
    other_triple = store.register(artifact_factory(seed=1, calibration="chat"))
    assert other_triple.artifact_sha256 != shared.artifact_sha256  # mapper.json differs: other address
    store.remove(shared)
    assert _object_dirs(store) == [store.artifacts_dir / other_triple.artifact_location]
    store.verify(other_triple)


def test_gc_removes_orphans_and_never_a_referenced_artifact(store, artifact_factory):
    kept = [store.register(artifact_factory(seed=seed)) for seed in range(3)]
    orphan = store.artifacts_dir / "sha256" / "ab" / ("ab" + "0" * 62)
    orphan.mkdir(parents=True)
    (orphan / "mapper.json").write_text("{}")
    debris = store.artifacts_dir / ".tmp" / "deadbeef"
    debris.mkdir(parents=True)
    (debris / "mapper.safetensors").write_bytes(b"partial")
    dry = store.gc(dry_run=True)
    assert [location for location, _ in dry.artifacts] == [f"sha256/ab/{orphan.name}"]
    assert [name for name, _ in dry.temporaries] == ["deadbeef"] and orphan.exists() and debris.exists()
    report = store.gc()
    assert report.bytes == dry.bytes > 0 and not orphan.exists() and not debris.exists()
    for version in kept:
        store.verify(version)
    assert store.gc().artifacts == [] and store.gc().missing == []


def test_two_stores_sharing_an_artifacts_folder_never_collect_each_other(tmp_path, artifact_factory):
    shared = tmp_path / "shared-artifacts"
    with (
        open_store(tmp_path / "a.db", artifacts_dir=shared) as first,
        open_store(tmp_path / "b.db", artifacts_dir=shared) as second,
    ):
        version = first.register(artifact_factory(seed=1))
        assert first.artifacts_dir != second.artifacts_dir
        assert second.gc().artifacts == []
        first.verify(version)


# ---- integrity at load ---------------------------------------------------------------------------
def _writable(path: Path) -> Path:
    path.chmod(0o644)
    return path


def test_changed_tensor_bytes_are_refused_at_load(store, artifact_factory):
    from kvhub.core.mapper import Mapper

    version = store.register(artifact_factory(seed=1))
    assert Mapper.load(store.artifact_path(version)).metadata["tensors"]["sha256"] == version.tensors_sha256
    tensors = _writable(store.artifact_path(version) / "mapper.safetensors")
    data = bytearray(tensors.read_bytes())
    data[len(data) // 2] ^= 0x01
    tensors.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="sha256"):
        Mapper.load(store.artifact_path(version))
    with pytest.raises(IntegrityError, match="sha256"):
        store.verify(version)


def test_kvhub_load_refuses_changed_bytes(tmp_path, artifact_factory):
    import kvhub

    db = tmp_path / "kvhub.db"
    with open_store(db) as opened:
        version = opened.register(artifact_factory(seed=1))
        path = opened.artifact_path(version)
    assert kvhub.load("tiny-coder-0.5b-instruct", "TINY-CODER-1.5B-INSTRUCT", db=str(db)).num_parameters() > 0
    tensors = _writable(path / "mapper.safetensors")
    tensors.write_bytes(tensors.read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(IntegrityError, match="sha256"):
        kvhub.load(SRC_ID, DST_ID, db=str(db))


def test_changed_or_missing_metadata_is_refused(store, artifact_factory):
    version = store.register(artifact_factory(seed=1))
    path = store.artifact_path(version)
    metadata = _writable(path / "mapper.json")
    metadata.write_text(metadata.read_text().replace('"k": 1', '"k": 2'))
    with pytest.raises(IntegrityError, match="manifest"):
        store.artifact_path(version)
    os.chmod(path, 0o755)
    metadata.unlink()
    with pytest.raises(IntegrityError):
        store.artifact_path(version)


def test_export_copies_a_verified_artifact(store, artifact_factory, tmp_path):
    version = store.register(artifact_factory(seed=1))
    out = store.export(f"{PAIR}@v1", tmp_path / "exported")
    assert sorted(p.name for p in out.iterdir()) == ["mapper.json", "mapper.safetensors"]
    with pytest.raises(ArtifactError, match="already exists"):
        store.export(version, out)
    again = store.register(out)  # what export writes, import takes back: the same version
    assert again.id == version.id


# ---- metrics, publications, listing --------------------------------------------------------------
def test_metrics_and_publications(store, artifact_factory):
    version = store.register(artifact_factory(seed=1))
    added = store.add_metrics(
        version,
        [
            {"name": "hellaswag_acc", "value": 0.41, "split": "validation", "task": "hellaswag", "n": 500, "seed": 0},
            {"name": "attn_cos", "value": 0.97, "split": "heldout", "layer": 1},
        ],
    )
    assert added == 2
    rows = store.metrics(version, names=["hellaswag_acc"])
    assert rows[0]["task"] == "hellaswag" and rows[0]["n"] == 500 and rows[0]["kvhub_version"]
    with pytest.raises(NonFiniteError):
        store.add_metrics(version, [{"name": "bad", "value": float("nan")}])
    with pytest.raises(ConfigError, match="only have the keys"):
        store.add_metrics(version, [{"name": "bad", "value": 1.0, "colour": "red"}])
    store.add_publication(version, "acme/kvmap", "v1", "c0ffee")
    assert store.publications(f"{PAIR}@v1") == [
        {
            "repo_id": "acme/kvmap",
            "revision": "v1",
            "commit_sha": "c0ffee",
            "published_at": store.publications(version)[0]["published_at"],
        }
    ]


def test_list_filters(store, artifact_factory):
    store.register(artifact_factory(seed=1, metrics={"heldout_r2_k_mean": 0.5}))
    store.register(artifact_factory(seed=2, metrics={"heldout_r2_k_mean": 0.95}))
    store.register(artifact_factory(seed=3, calibration="chat"))
    assert len(store.versions()) == 3
    assert [v.version for v in store.versions(min_metrics={"heldout_r2_k_mean": 0.9})] == [2]
    assert {v.calibration for v in store.versions(calibration="CHAT")} == {"chat"}
    assert len(store.versions(source="tiny-coder-0.5b-instruct", family="QWEN2")) == 3
    assert store.versions(family="llama") == [] and store.versions(source="unknown") == []


# ---- where the store lives -----------------------------------------------------------------------
def test_locations_follow_the_environment(tmp_path, monkeypatch):
    from kvhub.store.location import default_artifacts_dir, resolve_db_url

    monkeypatch.delenv("KVHUB_DB_URL", raising=False)
    monkeypatch.setenv("KVHUB_HOME", str(tmp_path / "home"))
    assert resolve_db_url() == f"sqlite:///{tmp_path / 'home' / 'kvhub.db'}"
    assert default_artifacts_dir(resolve_db_url()) == tmp_path / "home" / "artifacts"
    monkeypatch.setenv("KVHUB_DB_URL", "postgresql+psycopg://u@h/db")
    assert resolve_db_url() == "postgresql+psycopg://u@h/db"
    assert default_artifacts_dir(resolve_db_url()) == tmp_path / "home" / "artifacts"
    assert resolve_db_url(tmp_path / "x.db") == f"sqlite:///{tmp_path / 'x.db'}"
    with open_store(tmp_path / "y.db") as opened:
        assert opened.artifacts_dir.parent == tmp_path / "artifacts"


def test_sqlite_foreign_keys_are_on(tmp_path):
    with open_store(tmp_path / "k.db") as opened, opened._engine.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1


def test_an_unreachable_server_is_a_store_error_without_the_password():
    with pytest.raises(StoreError, match="cannot use the store") as caught:
        open_store("postgresql+psycopg://kvhub:s3cret@127.0.0.1:1/kvhub")
    assert "s3cret" not in str(caught.value) and "kvhub:***@" in str(caught.value)


def test_row_identities_and_json_hashes_are_pinned():
    """Stores written by older kvhub look their model and calibration rows up by these hashes: the
    canonical JSON (sorted keys, json's default separators) must never change."""
    from kvhub.artifact import json_sha256
    from kvhub.store.ingest import _identity

    assert _identity("Qwen/Qwen2.5-0.5B", None, "c0ffee", None) == (
        "6a29b437a07383b3095d0f9a7d6896e75734152e0e50a9a1c4623335307e9953"
    )
    assert (
        json_sha256({"b": [1, 2], "a": "x"})
        == json_sha256({"a": "x", "b": [1, 2]})
        == ("5125d018f84d57c49a8d3c2cfa6063d23cc3f4cd7ff13f4fdedfa2c1d3162f30")
    )
