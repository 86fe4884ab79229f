"""Every bad input the serving KV store (kvhub.serving.kvstore.KVStore) can be handed, one row each.

REFUSED: a call that must raise the named kvhub error (or builtin) with a message naming the problem.
BAD_INDEX: a planted index file of tenant bob that must be a miss, never tenant alice's entry.
ACCEPTED: odd inputs that are fine and must work.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from kvhub.errors import ConfigError, IncompatibleError, KVStoreError
from kvhub.serving.kvstore import KVStore, StoredPrefix

CHUNK, HEADS, DIM, LAYERS = 4, 2, 3, 2
IDS = list(range(1, 17))  # 4 chunks


def _store(root: Path, *, max_bytes: int = 1 << 20) -> KVStore:
    return KVStore(root, max_bytes=max_bytes, chunk_tokens=CHUNK)


def _kv(tokens: int = len(IDS), layers: int = LAYERS):
    return [torch.randn(HEADS, tokens, DIM) for _ in range(layers)]


def _put(root: Path, *, tenant="alice", ids=IDS, keys=None, values=None, max_bytes=1 << 20):
    keys = _kv(len(ids)) if keys is None else keys
    values = _kv(len(ids)) if values is None else values
    return _store(root, max_bytes=max_bytes).put(
        isolation_key=tenant, source_model="src", token_ids=ids, keys=keys, values=values
    )


def _lookup(root: Path, *, tenant="alice", ids=IDS, **options):
    return _store(root).longest_prefix(isolation_key=tenant, source_model="src", token_ids=ids, **options)


def _read(entry: Path, *, start=0, end=len(IDS)):  # noqa: B008 - IDS is a constant
    return KVStore.read(entry, token_ids=IDS, start=start, end=end)


# ---- damage helpers: each takes the store directory ---------------------------------------------------
def _in_place_of_store_json(write):
    def case(root: Path):
        root.mkdir()
        write(root / "store.json")
        _store(root)

    return case


def _fifo(path: Path):
    os.mkfifo(path)


def _kvstore_dir_is_a_file(root: Path):
    root.write_text("not a directory")
    _store(root)


def _kvstore_dir_under_a_file(root: Path):
    root.write_text("not a directory")
    _store(root / "kv")


def _pins_is_a_file(root: Path):
    root.mkdir()
    (root / "pins").write_text("x")
    _store(root)


def _pins_is_a_link(root: Path):
    root.mkdir()
    (root.parent / "elsewhere").mkdir()
    (root / "pins").symlink_to(root.parent / "elsewhere", target_is_directory=True)
    _store(root)


def _namespaces_a_link(root: Path):
    _store(root)
    (root.parent / "elsewhere").mkdir()
    (root / "ns").symlink_to(root.parent / "elsewhere", target_is_directory=True)
    _put(root)


def _damaged_entry(damage):
    def case(root: Path):
        entry = _put(root)
        damage(entry)
        _read(entry)

    return case


def _truncate(entry: Path):
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])


def _swap_for_link(entry: Path):
    target = entry.with_name("target")
    entry.rename(target)
    entry.symlink_to(target)


def _swap_for_dir(entry: Path):
    entry.unlink()
    entry.mkdir()


def _metadata_says_three_layers(entry: Path):  # what a put of 3 key layers and 2 value layers used to write (K24)
    from safetensors.torch import load_file, save_file

    save_file(load_file(str(entry)), str(entry), metadata={"source_model": "src", "layers": "3"})


def _read_rows(start, end):
    def case(root: Path):
        _read(_put(root), start=start, end=end)

    return case


REFUSED = [
    # the constructor: options
    pytest.param(lambda root: KVStore(root, max_bytes=0), ConfigError, "size cap", id="max_bytes-zero"),
    pytest.param(lambda root: KVStore(root, max_bytes=-5), ConfigError, "size cap", id="max_bytes-negative"),
    pytest.param(lambda root: KVStore(root, max_bytes="1GiB"), ConfigError, "whole number", id="max_bytes-text"),
    pytest.param(lambda root: KVStore(root, max_bytes=1.5e9), ConfigError, "whole number", id="max_bytes-float"),
    pytest.param(lambda root: KVStore(root, max_bytes=True), ConfigError, "whole number", id="max_bytes-bool"),
    pytest.param(lambda root: KVStore(root, max_bytes=None), ConfigError, "whole number", id="max_bytes-none"),
    pytest.param(
        lambda root: KVStore(root, max_bytes=1 << 20, chunk_tokens=0),
        ConfigError,
        "chunk_tokens",
        id="chunk_tokens-zero",
    ),
    pytest.param(
        lambda root: KVStore(root, max_bytes=1 << 20, chunk_tokens="sixteen"),
        ConfigError,
        "chunk_tokens",
        id="chunk_tokens-text",
    ),
    pytest.param(lambda root: KVStore("", max_bytes=1 << 20), ConfigError, "non-empty path", id="kvstore_dir-empty"),
    pytest.param(lambda root: KVStore(None, max_bytes=1 << 20), ConfigError, "non-empty path", id="kvstore_dir-none"),
    # the constructor: the directory
    pytest.param(_kvstore_dir_is_a_file, ConfigError, "is not a directory.*point kvstore_dir", id="kvstore_dir-a-file"),
    pytest.param(_kvstore_dir_under_a_file, ConfigError, "is not a directory", id="kvstore_dir-under-a-file"),
    pytest.param(_pins_is_a_file, ConfigError, "is not a directory", id="pins-a-file"),
    pytest.param(_pins_is_a_link, ConfigError, "is not a directory", id="pins-a-link"),
    pytest.param(
        _in_place_of_store_json(lambda p: p.write_text('{"format": ')),
        ConfigError,
        "store.json is damaged.*remove it",
        id="store_json-truncated",
    ),
    pytest.param(
        _in_place_of_store_json(lambda p: p.write_text("garbage")),
        ConfigError,
        "store.json is damaged",
        id="store_json-garbage",
    ),
    pytest.param(
        _in_place_of_store_json(lambda p: p.write_bytes(b"\xff\xfe\x00")),
        ConfigError,
        "store.json is damaged",
        id="store_json-binary",
    ),
    pytest.param(
        _in_place_of_store_json(lambda p: p.write_text("")), ConfigError, "store.json is damaged", id="store_json-empty"
    ),
    pytest.param(
        _in_place_of_store_json(lambda p: p.mkdir()), ConfigError, "store.json is damaged", id="store_json-a-directory"
    ),
    pytest.param(
        _in_place_of_store_json(lambda p: p.symlink_to("/dev/zero")),
        ConfigError,
        "store.json is damaged.*symbolic link",
        id="store_json-a-link",
    ),
    pytest.param(_in_place_of_store_json(_fifo), ConfigError, "store.json is damaged", id="store_json-a-fifo"),
    pytest.param(
        _in_place_of_store_json(lambda p: p.write_text("[1, 16]")),
        ConfigError,
        "was created with",
        id="store_json-a-list",
    ),
    pytest.param(
        _in_place_of_store_json(lambda p: p.write_text(json.dumps({"format": 1, "chunk_tokens": 8}))),
        ConfigError,
        "same chunk_tokens",
        id="store_json-other-chunk",
    ),
    # put: keys and values that do not pair up (K24)
    pytest.param(
        lambda root: _put(root, keys=_kv(layers=3), values=_kv(layers=2)),
        IncompatibleError,
        "3 layers of keys but 2 layers of values",
        id="put-3-key-layers-2-value-layers",
    ),
    pytest.param(
        lambda root: _put(root, keys=_kv(layers=1), values=_kv(layers=2)),
        IncompatibleError,
        "1 layers of keys but 2",
        id="put-1-key-layer-2-value-layers",
    ),
    pytest.param(lambda root: _put(root, keys=[], values=[]), IncompatibleError, "at least one", id="put-no-layers"),
    pytest.param(
        lambda root: _put(root, keys=[torch.zeros(HEADS, 16, DIM)] * 2, values=[torch.zeros(HEADS, 16, DIM + 1)] * 2),
        IncompatibleError,
        r"keys \(2, 16, 3\) / values \(2, 16, 4\)",
        id="put-head-dim-mismatch",
    ),
    pytest.param(
        lambda root: _put(root, keys=_kv(tokens=15), values=_kv(tokens=15)),
        IncompatibleError,
        "do not cover 16 tokens",
        id="put-too-few-rows",
    ),
    pytest.param(
        lambda root: _put(root, keys=[torch.zeros(16, DIM)] * 2, values=[torch.zeros(16, DIM)] * 2),
        IncompatibleError,
        r"\(heads, tokens, head_dim\)",
        id="put-2d-tensors",
    ),
    pytest.param(
        lambda root: _put(root, keys=[[0.0]] * 2, values=[[0.0]] * 2),
        IncompatibleError,
        "must be tensors",
        id="put-lists-not-tensors",
    ),
    pytest.param(
        lambda root: _put(root, keys=torch.zeros(2, HEADS, 16, DIM), values=_kv()),
        IncompatibleError,
        "lists of tensors",
        id="put-one-tensor-not-a-list",
    ),
    # put: token ids and keys of the namespace
    pytest.param(
        lambda root: _put(root, ids=[float(t) + 0.5 for t in IDS]), ConfigError, "integers", id="put-float-token-ids"
    ),
    pytest.param(lambda root: _put(root, ids=[str(t) for t in IDS]), ConfigError, "integers", id="put-text-token-ids"),
    pytest.param(
        lambda root: _put(root, ids=IDS[:-1] + [2**70]), ConfigError, "int64 range", id="put-token-id-too-large"
    ),
    pytest.param(
        lambda root: _put(root, tenant=None), ConfigError, "isolation_key must be a string", id="put-isolation-key-none"
    ),
    pytest.param(
        lambda root: _put(root, tenant=7), ConfigError, "isolation_key must be a string", id="put-isolation-key-int"
    ),
    # put: a cap below one entry (K20) stores nothing rather than a path to an evicted entry
    pytest.param(
        lambda root: _put(root, max_bytes=100),
        ConfigError,
        "more than the size cap.*raise kvstore_max_bytes",
        id="put-entry-larger-than-cap",
    ),
    # put: a planted link is the KV store's own error (exit 17), not the SQL registry's StoreError
    pytest.param(_namespaces_a_link, KVStoreError, "not a plain directory.*nothing stored", id="put-ns-a-link"),
    # lookups
    pytest.param(lambda root: _lookup(root, ids=[0.5] * 16), ConfigError, "integers", id="lookup-float-token-ids"),
    pytest.param(lambda root: _lookup(root, tenant=None), ConfigError, "isolation_key", id="lookup-isolation-key-none"),
    pytest.param(
        lambda root: _lookup(root, max_tokens=2.5),
        ConfigError,
        "max_tokens must be an integer",
        id="lookup-max-tokens-float",
    ),
    pytest.param(
        lambda root: _read(_put(root), start=0, end=8.0), ConfigError, "end must be an integer", id="read-float-end"
    ),
    # read: rows
    pytest.param(_read_rows(8, 4), ConfigError, r"0 <= start <= end", id="read-start-after-end"),
    pytest.param(_read_rows(-4, 8), ConfigError, r"0 <= start <= end", id="read-negative-start"),
    pytest.param(_read_rows(0, 17), IncompatibleError, "does not hold the first 17 tokens", id="read-past-the-entry"),
    # read: entries that are not what put writes
    pytest.param(_damaged_entry(_truncate), IncompatibleError, "damaged or not a kvhub entry", id="read-truncated"),
    pytest.param(
        _damaged_entry(lambda e: e.write_bytes(b"garbage" * 20)), IncompatibleError, "damaged", id="read-garbage"
    ),
    pytest.param(_damaged_entry(lambda e: e.write_bytes(b"")), IncompatibleError, "damaged", id="read-empty"),
    pytest.param(
        _damaged_entry(_metadata_says_three_layers),
        IncompatibleError,
        "metadata says 3 layers",
        id="read-layers-metadata-wrong",
    ),
    pytest.param(_damaged_entry(_swap_for_link), IncompatibleError, "symbolic link", id="read-a-link"),
    pytest.param(_damaged_entry(_swap_for_dir), IncompatibleError, "not a regular file", id="read-a-directory"),
    pytest.param(_damaged_entry(lambda e: e.unlink()), FileNotFoundError, "No such file", id="read-gone"),
]


@pytest.mark.parametrize("case, error, match", REFUSED)
def test_refused(tmp_path, case, error, match):
    with pytest.raises(error, match=match):
        case(tmp_path / "store")


# ---- planted index files of bob that name alice's entry (R2) -------------------------------------------
def _write(text: str):
    return lambda index, alice: index.write_text(text.format(alice=alice, ns=alice.parent.parent.name, name=alice.name))


def _link_entry_into_bobs_namespace(index: Path, alice: Path):
    (index.parent.parent / "entries" / alice.name).symlink_to(alice)
    index.write_text(alice.name)


BAD_INDEX = [
    pytest.param(_write("../../{ns}/entries/{name}"), True, id="dot-dot-path"),
    pytest.param(_write("{alice}"), True, id="absolute-path"),
    pytest.param(_write("../entries/../../{ns}/entries/{name}"), True, id="nested-dot-dot"),
    pytest.param(_write("{name}/../../../{ns}/entries/{name}"), True, id="name-then-dot-dot"),
    pytest.param(_write("{name}\n"), True, id="trailing-newline"),
    pytest.param(_write(""), True, id="empty"),
    pytest.param(_write("\x00\xff garbage"), True, id="garbage"),
    pytest.param(_write("{ns}-16.safetensors"), True, id="name-of-no-entry"),  # well formed, nothing there
    pytest.param(_write("0" * 40 + "-4.safetensors"), True, id="fewer-tokens-than-the-prefix"),
    pytest.param(
        lambda index, alice: index.symlink_to(alice.parent.parent / "index" / index.name),
        True,
        id="index-a-link-to-alices-index",
    ),
    pytest.param(lambda index, alice: index.mkdir(), False, id="index-a-directory"),
    pytest.param(lambda index, alice: os.mkfifo(index), True, id="index-a-fifo"),
    pytest.param(_link_entry_into_bobs_namespace, True, id="entry-a-link-to-alices"),
]


@pytest.mark.parametrize("plant, removed", BAD_INDEX)
def test_a_bad_index_file_is_a_miss_never_another_tenants_entry(tmp_path, plant, removed):
    alice = _put(tmp_path)
    _put(tmp_path, tenant="bob", ids=[99] * 8)  # bob's namespace exists
    os.utime(alice, (1e9, 1e9))
    store = _store(tmp_path)
    bob = KVStore.namespace("bob", "src")
    index = tmp_path / "ns" / bob / "index" / store.prefix_hashes(bob, IDS)[-1]
    plant(index, alice)
    assert store.longest_prefix(isolation_key="bob", source_model="src", token_ids=IDS) is None
    assert os.path.lexists(index) is not removed
    assert store.pin(StoredPrefix(index.parent.parent / "entries" / alice.name, 16)) is None
    assert alice.stat().st_mtime == 1e9 and list((tmp_path / "pins").iterdir()) == []


# ---- odd inputs that are fine ---------------------------------------------------------------------------
def _same_tensor_as_key_and_value(root: Path):
    shared = _kv()
    entry = _put(root, keys=shared, values=shared)
    keys, values = _read(entry)
    assert torch.equal(keys[1][0], shared[1]) and torch.equal(values[1][0], shared[1])


def _negative_max_tokens_is_no_prefix(root: Path):
    _put(root)
    assert _lookup(root, max_tokens=-4) is None  # not "all but the last 4"
    assert _lookup(root, max_tokens=9).tokens == 8


def _release_leaves_what_is_not_a_pin(root: Path):
    entry = _put(root)
    KVStore.release(entry)
    KVStore.release("")
    assert entry.exists()


def _short_prompt_stores_nothing(root: Path):
    assert _put(root, ids=IDS[:3], keys=_kv(3), values=_kv(3)) is None
    assert not (root / "ns").exists()


def _numpy_token_ids(root: Path):
    import numpy as np

    _put(root, ids=[np.int64(t) for t in IDS])
    assert _lookup(root).tokens == 16


def _read_of_no_rows(root: Path):
    keys, _ = _read(_put(root), start=8, end=8)
    assert keys[0].shape == (1, HEADS, 0, DIM)


ACCEPTED = [
    pytest.param(_same_tensor_as_key_and_value, id="same-tensor-as-keys-and-values"),
    pytest.param(_negative_max_tokens_is_no_prefix, id="lookup-negative-max-tokens"),
    pytest.param(_release_leaves_what_is_not_a_pin, id="release-of-a-non-pin"),
    pytest.param(_short_prompt_stores_nothing, id="put-shorter-than-a-chunk"),
    pytest.param(_numpy_token_ids, id="put-numpy-token-ids"),
    pytest.param(_read_of_no_rows, id="read-empty-row-range"),
]


@pytest.mark.parametrize("case", ACCEPTED)
def test_accepted(tmp_path, case):
    case(tmp_path / "store")
