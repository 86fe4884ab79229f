"""Every bad input a user (or a malicious artifact, Hub repository or shared database) can hand kvhub,
table by table: each is refused with a kvhub error and its documented exit code, no traceback, and
nothing is registered, published or deleted (docs/artifact-format.md, docs/store.md, docs/hub.md).

Tables: ARTIFACT_CASES (a damaged artifact directory: `kvhub import`, Mapper.load and the Hub's
verify_artifact), STORE_CASES (store commands), CACHE_CASES (Mapper.transfer), HUB_CASES (`kvhub pull`
of a crafted repository).  ``test_case_count`` states how many there are.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from kvhub.artifact import read_artifact
from kvhub.errors import ArtifactError, ConfigError, IncompatibleError, NonFiniteError
from kvhub.core.mapper import Mapper
from tests.fixtures_store import DST_ID, SRC_ID, make_store_artifact, mlp_artifact

# ---- artifact damage helpers -------------------------------------------------------------------------


def _meta(directory: Path) -> dict:
    return json.loads((directory / "mapper.json").read_text())


def _edit(change):
    """Damage: change(metadata) edits mapper.json in place (or returns a replacement document)."""

    def damage(directory: Path) -> None:
        metadata = _meta(directory)
        replaced = change(metadata)
        (directory / "mapper.json").write_text(json.dumps(metadata if replaced is None else replaced))

    return damage


def _raw_json(data: bytes):
    def damage(directory: Path) -> None:
        (directory / "mapper.json").write_bytes(data)

    return damage


def _rehash(directory: Path) -> None:
    """Record the tensor file's current sha256 in mapper.json: damage that passes the hash check."""
    from kvhub.artifact import sha256_file

    metadata = _meta(directory)
    metadata["tensors"]["sha256"] = sha256_file(directory / "mapper.safetensors")
    (directory / "mapper.json").write_text(json.dumps(metadata))


def _tensors(change):
    """Damage: change(tensors) edits the tensor dict; the file is rewritten and its sha256 recorded."""

    def damage(directory: Path) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(directory / "mapper.safetensors"))
        change(tensors)
        save_file(tensors, str(directory / "mapper.safetensors"))
        _rehash(directory)

    return damage


def _tensor_bytes(change):
    """Damage: change(bytes) -> bytes of the tensor file; its sha256 recorded."""

    def damage(directory: Path) -> None:
        path = directory / "mapper.safetensors"
        path.write_bytes(change(path.read_bytes()))
        _rehash(directory)

    return damage


def _header_edit(change):
    """Damage: change(header dict) edits the safetensors header in place (same data bytes)."""

    def edit(data: bytes) -> bytes:
        length = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8 : 8 + length])
        change(header)
        text = json.dumps(header).encode()
        return struct.pack("<Q", len(text)) + text + data[8 + length :]

    return _tensor_bytes(edit)


def _set(path: str, value):
    """mapper.json edit setting a dotted path (``layers.0.target``) to ``value``; ``...`` deletes it."""

    def change(metadata):
        *parents, last = path.split(".")
        node = metadata
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        key = int(last) if isinstance(node, list) else last
        if value is ...:
            del node[key]
        else:
            node[key] = value

    return _edit(change)


def _link(name: str, target_of):
    def damage(directory: Path) -> None:
        target = target_of(directory)
        (directory / name).unlink(missing_ok=True)
        os.symlink(target, directory / name)

    return damage


def _secret(directory: Path) -> Path:
    secret = directory.parent / f"{directory.name}-secret.txt"
    secret.write_text("TOP-SECRET-CONTENT-12345")
    return secret


def _outside_copy(directory: Path) -> str:
    outside = directory.parent / f"{directory.name}-outside.safetensors"
    outside.write_bytes((directory / "mapper.safetensors").read_bytes())
    return str(outside)


_DEEP = "[" * 5000 + "]" * 5000  # lists 5000 deep: past the JSON parser's recursion limit


def _nested_json(directory: Path) -> None:
    """mapper.json with a `notes` field nested 5000 lists deep."""
    metadata = _meta(directory)
    metadata["notes"] = "NESTED"
    (directory / "mapper.json").write_text(json.dumps(metadata).replace('"NESTED"', _DEEP))


def _nested_header(data: bytes) -> bytes:
    """The safetensors header with a `__metadata__`-like entry nested 5000 lists deep (same data bytes)."""
    length = struct.unpack("<Q", data[:8])[0]
    text = data[8 : 8 + length].rstrip(b" ")[:-1] + b', "padding": ' + _DEEP.encode() + b"}"
    return struct.pack("<Q", len(text)) + text + data[8 + length :]


def _reversed_layers(metadata):
    metadata["layers"].reverse()


# (id, damage, words the message must contain, Mapper.load refuses it too)
ARTIFACT_CASES = [
    # mapper.json is not a JSON object of the right shape
    ("json-list", _raw_json(b"[]"), "must be a JSON object", True),
    ("json-null", _raw_json(b"null"), "must be a JSON object", True),
    ("json-string", _raw_json(b'"mapper"'), "must be a JSON object", True),
    ("json-number", _raw_json(b"3"), "must be a JSON object", True),
    ("json-invalid", _raw_json(b"{not json"), "not valid JSON", True),
    ("json-empty-file", _raw_json(b""), "not valid JSON", True),
    ("json-invalid-utf8", _raw_json(b'{"format_version": "\xff\xfe"}'), "not UTF-8", True),
    ("json-tensors-string", _set("tensors", "x"), "`tensors` must be a JSON object", True),
    ("json-source-list", _set("source", []), "`source` must be a JSON object", True),
    # format_version
    ("format-missing", _set("format_version", ...), "`format_version` is missing", True),
    ("format-true", _set("format_version", True), "`format_version` must be an integer", True),
    ("format-zero", _set("format_version", 0), "`format_version` must be an integer in 1..", True),
    ("format-negative", _set("format_version", -1), "`format_version` must be an integer in 1..", True),
    ("format-string", _set("format_version", "1"), "`format_version` must be an integer", True),
    ("format-float", _set("format_version", 1.0), "`format_version` must be an integer", True),
    ("format-newer", _set("format_version", 99), "upgrade", True),
    ("format-huge", _set("format_version", 10**30), "`format_version` must be an integer in 1..", True),
    # layers
    ("layers-missing", _set("layers", ...), "`layers` is missing", True),
    ("layers-empty", _set("layers", []), "`layers` has 0 entries", True),
    ("layers-not-list", _set("layers", {"0": 1}), "`layers` must be a list", True),
    ("layers-entry-null", _set("layers.0", None), "`layers[0]` must be a JSON object", True),
    ("layers-duplicate-target", _set("layers.1.target", 0), "repeats target layer 0", True),
    ("layers-target-out-of-range", _set("layers.0.target", 7), "`layers[0].target` must be an integer in 0..2", True),
    ("layers-target-negative", _set("layers.0.target", -1), "`layers[0].target` must be an integer in 0..2", True),
    ("layers-target-string", _set("layers.0.target", "1"), "`layers[0].target` must be an integer", True),
    ("layers-target-bool", _set("layers.0.target", False), "`layers[0].target` must be an integer", True),
    ("layers-one-missing", _edit(lambda m: m["layers"].__delitem__(-1)), "`layers` has 2 entries", True),
    ("sources-beyond", _set("layers.0.sources", [7]), "ascending distinct source layers in 0..1", True),
    ("sources-negative", _set("layers.0.sources", [-1]), "ascending distinct source layers in 0..1", True),
    ("sources-empty", _set("layers.0.sources", []), "non-empty list of layer indices", True),
    ("sources-string", _set("layers.0.sources", "0"), "`layers[0].sources` must be a list", True),
    ("sources-descending", _set("layers.0.sources", [1, 0]), "ascending distinct", True),
    ("sources-duplicate", _set("layers.0.sources", [0, 0]), "ascending distinct", True),
    ("sources-wrong-k", _set("layers.0.sources", [0, 1]), "k.0.weight of shape", True),
    ("lambda-k-negative", _set("layers.0.lambda_k", -1.0), "`layers[0].lambda_k` must be >= 0", True),
    ("lambda-k-nan", _set("layers.0.lambda_k", math.nan), "`layers[0].lambda_k` must be a finite number", True),
    ("r2-string", _set("layers.0.r2_k", "high"), "`layers[0].r2_k` must be", True),
    # per-layer R^2 drives de-shrinking (scale 1/sqrt(R^2)): Inf or > 1 would make the map the calibration mean
    ("r2-infinite", _set("layers.0.r2_k", math.inf), "`layers[0].r2_k` must be a finite number", True),
    ("r2-huge", _set("layers.1.r2_v", 1e300), "`layers[1].r2_v` must be at most 1", True),
    ("r2-above-one", _set("layers.2.r2_k", 7.5), "`layers[2].r2_k` must be at most 1", True),
    ("r2-nan", _set("layers.0.r2_v", math.nan), "`layers[0].r2_v` must be a finite number", True),
    ("train-r2-nan", _set("layers.1.train_r2_k", math.nan), "`layers[1].train_r2_k` must be a finite", True),
    ("ridge-r2-string", _set("layers.0.ridge_r2_k", "high"), "`layers[0].ridge_r2_k` must be", True),
    ("mlp-epochs-huge", _set("layers.0.mlp_epochs_k", 10**30), "`layers[0].mlp_epochs_k` must be an integer", True),
    # nested past Python's parser: a RecursionError, never a traceback
    ("json-nested-deep", _nested_json, "nested deeper than", True),
    ("header-nested-deep", _tensor_bytes(_nested_header), "nested deeper than", True),
    # fingerprints
    ("source-missing", _set("source", ...), "`source` is missing", True),
    ("target-config-missing", _set("target.config", ...), "`target.config` is missing", True),
    (
        "source-config-edited",
        _edit(lambda m: m["source"]["config"].update(rope_theta=500000.0)),
        "does not hash to its config_hash",
        True,
    ),
    ("source-kv-heads-contradict", _set("source.num_kv_heads", 4), "recorded config says 2", True),
    ("target-head-dim-contradict", _set("target.head_dim", 8), "recorded config says 16", True),
    ("num-layers-string", _set("target.num_layers", "3"), "`target.num_layers` must be an integer", True),
    ("num-layers-zero", _set("target.num_layers", 0), "`target.num_layers` must be an integer in 1..", True),
    ("model-id-empty", _set("source.model_id", " "), "`source.model_id` must be a non-empty string", True),
    ("model-id-number", _set("target.model_id", 5), "`target.model_id` must be a string", True),
    ("config-hash-short", _set("source.config_hash", "abc"), "`source.config_hash` has the wrong form", True),
    ("dtype-int8", _set("target.dtype", "int8"), "`target.dtype` must be one of", True),
    ("layer-types-numbers", _set("target.layer_types", [1, 2]), "must be a list of strings", True),
    # other fields
    ("k-zero", _set("k", 0), "`k` must be an integer >= 1", True),
    ("lambda-negative", _set("lambda", -0.5), "`lambda` must be a finite number >= 0", True),
    ("structure-groups-zero", _set("structure", {"head_groups": 0}), "`structure.head_groups`", True),
    ("metrics-list", _set("metrics", [1, 2]), "`metrics` must be a JSON object", True),
    ("calibration-string", _set("calibration", "legal"), "`calibration` must be a JSON object", True),
    ("kvhub-version-number", _set("kvhub_version", 1), "`kvhub_version` must be a string", True),
    # tensors.file and sha256
    ("tensors-file-parent", _set("tensors.file", "../outside.safetensors"), "plain file name", True),
    ("tensors-file-absolute", _set("tensors.file", "/etc/passwd"), "plain file name", True),
    ("tensors-file-subdir", _set("tensors.file", "sub/mapper.safetensors"), "plain file name", True),
    ("tensors-file-hidden", _set("tensors.file", ".mapper.safetensors"), "plain file name", True),
    ("tensors-file-missing-file", _set("tensors.file", "other.safetensors"), "lacks", True),
    ("tensors-sha-short", _set("tensors.sha256", "abc"), "`tensors.sha256` has the wrong form", True),
    ("tensors-sha-wrong", _set("tensors.sha256", "0" * 64), "sha256", True),
    ("tensors-bytes-negative", _set("tensors.bytes", -5), "`tensors.bytes`", True),
    # the tensor file (sha256 updated, so only opening it finds the damage)
    ("weights-nan", _tensors(lambda t: t["k.1.weight"].view(-1).__setitem__(3, math.nan)), "NaN or Inf", True),
    ("bias-inf", _tensors(lambda t: t["v.2.bias"].__setitem__(0, math.inf)), "NaN or Inf", True),
    ("tensor-missing", _tensors(lambda t: t.pop("v.2.bias")), "v.2.bias of shape None", True),
    ("tensor-extra", _tensors(lambda t: t.update(padding=torch.zeros(4))), "does not name (padding)", True),
    (
        "tensor-transposed",
        _tensors(lambda t: t.update({"k.0.weight": t["k.0.weight"].T.contiguous()})),
        "k.0.weight of shape (32, 16)",
        True,
    ),
    ("tensor-float16", _tensors(lambda t: t.update({"k.0.bias": t["k.0.bias"].half()})), "fp32", True),
    (
        "tensor-weight-and-factors",
        _tensors(lambda t: t.update({"k.0.weight_a": torch.zeros(16, 2), "k.0.weight_b": torch.zeros(2, 32)})),
        "either k.0.weight or both",
        True,
    ),
    (
        "target-mean-wrong-shape",
        _tensors(lambda t: t.update({"k.0.target_mean": torch.zeros(7)})),
        "k.0.target_mean of shape (7,)",
        True,
    ),
    (
        "head-local-3-groups",
        _tensors(lambda t: t.update({"k.0.weight": torch.zeros(3, 5, 10)})),
        "3 head groups, which do not divide",
        True,
    ),
    (
        "compressed-under-format-1",
        _tensors(lambda t: t.update({"k.0.weight": torch.zeros(2, 8, 16)})),
        "need format version 2",
        True,
    ),
    ("file-truncated", _tensor_bytes(lambda b: b[:-100]), "truncated or padded", True),
    ("file-trailing-bytes", _tensor_bytes(lambda b: b + b"\0" * 8), "truncated or padded", True),
    ("file-empty", _tensor_bytes(lambda b: b""), "not a safetensors file", True),
    ("header-length-huge", _tensor_bytes(lambda b: struct.pack("<Q", 1 << 40) + b[8:]), "header length", True),
    ("header-not-json", _tensor_bytes(lambda b: b[:8] + b"!" + b[9:]), "not valid JSON", True),
    ("header-overlapping", _header_edit(lambda h: h["k.1.bias"].update(data_offsets=[0, 128])), "data offsets", True),
    ("header-shape-lie", _header_edit(lambda h: h["k.0.bias"].update(shape=[16])), "bytes, not", True),
    # files that are not regular files
    ("figure-link-to-secret", _link("leak.png", _secret), "symbolic link", False),
    ("tensor-file-link", _link("mapper.safetensors", _outside_copy), "symbolic link", True),
    ("metadata-link", _link("mapper.json", lambda d: str(d.parent / "m.json")), "symbolic link", True),
    ("subdir-link", _link("figures", lambda d: str(d.parent)), "symbolic link", False),
    ("fifo", lambda d: os.mkfifo(d / "pipe.png"), "not a regular file", False),
    # store column limits (PostgreSQL would refuse the row after the copy)
    ("kvhub-version-too-long", _set("kvhub_version", "9" * 33), "`kvhub_version` is 33 characters", False),
    ("metric-name-too-long", _edit(lambda m: m["metrics"].update({"m" * 129: 0.5})), "characters long", False),
    ("calibration-name-missing", _set("calibration.name", ...), "names no calibration set", False),
    # kind: a name no kvhub gives a kind is damage, not a newer format ("upgrade" would not help)
    ("kind-empty", _set("kind", ""), "`kind` is '', not the name of a map kind", True),
    ("kind-upper-case", _set("kind", "MLP"), "did you mean 'mlp'?", True),
    ("kind-spaces", _set("kind", " ridge "), "did you mean 'ridge'?", True),
]

# The `mlp` block of a kind-mlp artifact: every field kvhub stores (the store's mlp_* columns) or shows.
MLP_CASES = [
    ("losses-nan", _set("mlp.losses.k.train", [math.nan] * 3), "`mlp.losses.k.train` must be a list of 3 finite"),
    ("losses-negative", _set("mlp.losses.v.heldout", [0.5, -1.0, 0.5]), "`mlp.losses.v.heldout` must be a list"),
    ("losses-too-many", _set("mlp.losses.v.heldout", [0.5] * 10**6), "`mlp.losses.v.heldout` must be a list of 3"),
    ("losses-text", _set("mlp.losses", "\x1b[31mred"), "`mlp.losses` must be"),
    ("losses-kind-missing", _set("mlp.losses.v", ...), "`mlp.losses` must be"),
    ("losses-split-missing", _set("mlp.losses.k.heldout", ...), "`mlp.losses.k` must be"),
    ("epochs-huge", _set("mlp.epochs", 10**30), "`mlp.epochs` must be an integer in 1.."),
    ("seed-text", _set("mlp.seed", "x"), "`mlp.seed` must be an integer"),
    ("batch-size-bool", _set("mlp.batch_size", True), "`mlp.batch_size` must be an integer"),
    ("lr-zero", _set("mlp.lr", 0), "`mlp.lr` must be a finite number > 0"),
    ("lr-infinite", _set("mlp.lr", math.inf), "`mlp.lr` must be a finite number > 0"),
    ("tokens-negative", _set("mlp.tokens.train", -5), "`mlp.tokens` must be"),
    ("tokens-list", _set("mlp.tokens", [1, 2]), "`mlp.tokens` must be"),
    ("width-too-wide", _set("mlp.width", 65537), "`mlp.width` must be an integer in 1..65536"),
    ("layer-ridge-r2-text", _set("layers.0.ridge_r2_k", "high"), "`layers[0].ridge_r2_k` must be"),
]


@pytest.fixture(scope="module")
def good_artifact(tmp_path_factory) -> Path:
    return make_store_artifact(tmp_path_factory.mktemp("good") / "m", seed=11)


@pytest.fixture(scope="module")
def bad_store(tmp_path_factory):
    """A store every refused import goes to: it must stay empty."""
    root = tmp_path_factory.mktemp("bad-store")
    return str(root / "kvhub.db"), root / "artifacts"


def _damaged(good: Path, tmp_path: Path, damage) -> Path:
    import shutil

    directory = tmp_path / "damaged"
    shutil.copytree(good, directory)
    (tmp_path / "m.json").write_text((good / "mapper.json").read_text())
    damage(directory)
    return directory


def run(*args: str):
    from kvhub.cli.main import main

    return CliRunner().invoke(main, list(args))


def assert_clean_exit(result, code: int, words: str | None = None) -> None:
    """Exit ``code``, a one-line kvhub error (no traceback, no uncaught exception)."""
    output = result.output  # stdout and stderr
    assert result.exit_code == code, output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in output
    if words is not None:
        assert words in " ".join(output.split()), output


def assert_store_empty(db: str, artifacts: Path) -> None:
    """Nothing registered, and nothing copied: no stored artifact, no leftovers."""
    import sqlite3

    with sqlite3.connect(db) as connection:
        assert connection.execute("SELECT count(*) FROM mapper_versions").fetchone() == (0,)
    for store_dir in artifacts.iterdir() if artifacts.is_dir() else []:
        assert not any((store_dir / "sha256").rglob("*")), "an artifact was stored"
        assert not any((store_dir / ".tmp").glob("*")), "a copy was left behind"


TMP_COPY = f"{os.sep}.tmp{os.sep}"  # where the store copies an artifact before checking it


@pytest.mark.parametrize("case_id, damage, words, load_refuses", ARTIFACT_CASES, ids=[c[0] for c in ARTIFACT_CASES])
def test_damaged_artifact_is_refused_everywhere(
    case_id, damage, words, load_refuses, good_artifact, bad_store, tmp_path
):
    directory = _damaged(good_artifact, tmp_path, damage)
    db, artifacts = bad_store
    result = run("import", str(directory), "--db", db)
    assert_clean_exit(result, 5, words)
    assert TMP_COPY not in result.output  # the store's copy is gone when the user reads it: name the directory given
    assert_store_empty(db, artifacts)
    if load_refuses:
        with pytest.raises(ArtifactError):
            Mapper.load(directory)
        with pytest.raises(ArtifactError):
            read_artifact(directory)  # what pull, push and show --verify run


@pytest.fixture(scope="module")
def good_mlp_artifact(tmp_path_factory) -> Path:
    return mlp_artifact(tmp_path_factory.mktemp("good-mlp") / "m", seed=12)


@pytest.mark.parametrize("case_id, damage, words", MLP_CASES, ids=[c[0] for c in MLP_CASES])
def test_damaged_mlp_block_is_refused_everywhere(case_id, damage, words, good_mlp_artifact, bad_store, tmp_path):
    """Planted bugs caught: `mlp.losses` stored as given (NaN made list/show JSON invalid on SQLite and reached
    PostgreSQL as a raw database refusal); the schedule fields (epochs, seed, lr, tokens) stored unchecked."""
    directory = _damaged(good_mlp_artifact, tmp_path, damage)
    db, artifacts = bad_store
    result = run("import", str(directory), "--db", db)
    assert_clean_exit(result, 5, words)
    assert TMP_COPY not in result.output
    assert_store_empty(db, artifacts)
    with pytest.raises(ArtifactError, match="re-fetch it or re-fit"):
        Mapper.load(directory)


def test_the_good_mlp_artifact_imports(good_mlp_artifact, tmp_path):
    """The control of the table above: the undamaged mlp artifact, its whole `mlp` block, is accepted."""
    result = run("import", str(good_mlp_artifact), "--db", str(tmp_path / "kvhub.db"), "--json")
    assert_clean_exit(result, 0)
    assert json.loads(result.stdout)["mlp_losses"]["k"]["train"] == [0.5] * 3


def test_reordered_layers_are_accepted_and_each_map_lands_on_its_target(good_artifact, tmp_path):
    """A permutation of `layers` is a valid artifact; transfer places by `target`, not list position."""
    from transformers import DynamicCache

    directory = _damaged(good_artifact, tmp_path, _edit(_reversed_layers))
    reordered, original = Mapper.load(directory), Mapper.load(good_artifact)
    assert [layer["target"] for layer in reordered.layers] == [2, 1, 0]
    cache = DynamicCache()
    generator = torch.Generator().manual_seed(0)
    for index in range(2):
        cache.update(torch.randn(1, 2, 5, 8, generator=generator), torch.randn(1, 2, 5, 8, generator=generator), index)
    for got, want in zip(reordered.transfer(cache).layers, original.transfer(cache).layers):
        assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)


# ---- store commands ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    """A store with one registered version (and one from a model whose id contains Rich markup); shared by
    the store cases, which each check that they left it as it was."""
    tmp_path = tmp_path_factory.mktemp("filled")
    db = str(tmp_path / "store" / "kvhub.db")
    for seed, source in ((1, SRC_ID), (2, "acme/we[/]ird[bold]")):
        run("import", str(make_store_artifact(tmp_path / f"in{seed}", seed=seed, source=source)), "--db", db)
    return db, tmp_path


_REF = "tiny-coder-0.5b-instruct:tiny-coder-1.5b-instruct"
# (id, command arguments, exit code, words the message must contain)
STORE_CASES = [
    ("show-markup-ref", ["show", "a[/]:b"], 6, "no mapper from model 'a[/]'"),
    ("show-miss-lists-markup-names", ["show", "nosuch:dst"], 6, "acme/we[/]ird[bold]"),
    ("show-huge-version", ["show", f"{_REF}@v99999999999999999999"], 2, "version numbers run from 1 to"),
    ("rm-huge-version", ["rm", f"{_REF}@v99999999999999999999"], 2, "version numbers run from 1 to"),
    ("show-version-zero", ["show", f"{_REF}@v0"], 2, "version numbers run from 1 to"),
    ("show-missing-version", ["show", f"{_REF}@v7"], 6, "has no version v7"),
    ("show-empty-selector", ["show", f"{_REF}@"], 2, "names no version or alias"),
    ("show-not-a-ref", ["show", "just-one-name"], 2, "is not a mapper reference"),
    ("tag-version-like-alias", ["tag", f"{_REF}@v1", "v3"], 2, "cannot be an alias"),
    ("tag-latest", ["tag", f"{_REF}@v1", "latest"], 2, "maintained by the store"),
    ("tag-markup-alias", ["tag", f"{_REF}@v1", "[bold]x"], 2, "'[bold]x' cannot be an alias"),
    ("untag-unset-alias", ["untag", _REF, "production"], 6, "has no alias 'production'"),
    ("min-metric-no-name", ["list", "--min-metric", "=1"], 2, "write NAME=VALUE"),
    ("min-metric-nan", ["list", "--min-metric", "x=nan"], 2, "write NAME=VALUE"),
    ("min-metric-no-number", ["list", "--min-metric", "x=high"], 2, "write NAME=VALUE"),
    ("db-without-driver", ["list", "--db", "postgresql+nosuchdriver://u@127.0.0.1:1/x"], 2, "kvhub[postgres]"),
    ("db-not-a-url", ["list", "--db", "::::://"], 2, None),
    ("export-existing-dir", ["export", f"{_REF}@v1", "."], 2, ". already exists: pass --force to replace it"),
    ("import-no-such-dir", ["import", "no/such/dir"], 2, "does not exist"),
    ("export-markup-ref", ["export", "a[/]:b", "out"], 6, "no mapper from model 'a[/]'"),
    ("import-markup-dir-not-artifact", ["import", "[bold]x[red]"], 5, "[bold]x[red] is not a kvhub mapper artifact"),
]


@pytest.mark.parametrize("case_id, args, code, words", STORE_CASES, ids=[c[0] for c in STORE_CASES])
def test_store_command_refuses_bad_input(case_id, args, code, words, filled, monkeypatch):
    db, tmp_path = filled
    monkeypatch.chdir(tmp_path)
    (tmp_path / "[bold]x[red]").mkdir(exist_ok=True)
    before = run("list", "--db", db, "--json").stdout
    has_db = "--db" in args
    result = run(*args, *([] if has_db else ["--db", db]))
    assert_clean_exit(result, code, words)
    assert run("list", "--db", db, "--json").stdout == before  # nothing registered, removed or moved


# ---- caches handed to transfer() -----------------------------------------------------------------
def _cache(batch=1, tokens=5, dtype=torch.float32, layers=2):
    from transformers import DynamicCache

    cache = DynamicCache()
    for index in range(layers):
        cache.update(torch.ones(batch, 2, tokens, 8).to(dtype), torch.ones(batch, 2, tokens, 8).to(dtype), index)
    return cache


# (id, cache builder, transfer keyword arguments, error, words)
CACHE_CASES = [
    ("zero-tokens", lambda: _cache(tokens=0), {}, IncompatibleError, "empty"),
    ("zero-batch", lambda: _cache(batch=0), {}, IncompatibleError, "empty"),
    ("int-cache", lambda: _cache(dtype=torch.int64), {}, IncompatibleError, "floating point"),
    ("bool-cache", lambda: _cache(dtype=torch.bool), {}, IncompatibleError, "floating point"),
    ("wrong-layer-count", lambda: _cache(layers=3), {}, IncompatibleError, "source cache has 3 layers"),
    ("int8-output", lambda: _cache(), {"dtype": torch.int8}, ConfigError, "not a floating-point type"),
    ("unknown-output-dtype", lambda: _cache(), {"dtype": "float8"}, ConfigError, "unknown dtype"),
    ("nan-cache", lambda: _nan_cache(), {}, NonFiniteError, "NaN or Inf"),
    ("positions-shape", lambda: _cache(), {"position_ids": torch.arange(4)[None]}, IncompatibleError, "position_ids"),
    ("not-a-cache", lambda: object(), {}, IncompatibleError, "no .layers"),
]


def _nan_cache():
    cache = _cache()
    cache.layers[1].keys[0, 0, 0, 0] = math.nan
    return cache


@pytest.mark.parametrize("case_id, build, kwargs, error, words", CACHE_CASES, ids=[c[0] for c in CACHE_CASES])
def test_transfer_refuses_bad_caches(case_id, build, kwargs, error, words, good_artifact):
    with pytest.raises(error, match=words):
        Mapper.load(good_artifact).transfer(build(), **kwargs)


def test_huge_version_number_through_the_api(good_artifact, tmp_path):
    import kvhub

    db = str(tmp_path / "kvhub.db")
    run("import", str(good_artifact), "--db", db)
    with pytest.raises(ConfigError, match="version numbers run from 1 to"):
        kvhub.load(SRC_ID, DST_ID, version=99999999999999999999, db=db)


def test_other_headers_nested_past_the_parser_are_malformed_not_a_crash():
    """What kvhub parses besides mapper.json (a statistics checkpoint's header, a model card's front matter, the
    Hub's mapper.json during push): nested 5000 deep, each is malformed input its reader already handles.

    Planted bugs caught: a RecursionError escaping StatisticsMode.from_json (the checkpoint reader catches
    ValueError) or yaml.safe_load (read_front_matter catches YAMLError)."""
    from kvhub.artifact import parse_json
    from kvhub.fitting.modes import StatisticsMode
    from kvhub.hub.card import read_front_matter

    with pytest.raises(ValueError, match="nested deeper than"):
        parse_json(_DEEP)
    with pytest.raises(ValueError, match="nested deeper than"):
        StatisticsMode.from_json(_DEEP)
    assert read_front_matter(f"---\nkvhub: {_DEEP}\n---\n# card\n") == {}
