"""The connector's engine-independent parts: the shared KV store, the load plan, the paged-layout probe.

No vLLM needed; tests/serving/test_vllm_connector.py drives them inside the real engine.
"""

import errno
import os
from pathlib import Path

import pytest
import torch

from kvhub.errors import ConfigError, IncompatibleError, KVStoreError, UnsupportedModelError
from kvhub.serving import kvstore
from kvhub.serving.kvstore import KVStore, StoredPrefix
from kvhub.serving.paged import load_plan, probe_layout

LAYERS, HEADS, DIM = 3, 2, 8


def _kv(tokens, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(HEADS, tokens, DIM, generator=g) for _ in range(LAYERS)]
    values = [torch.randn(HEADS, tokens, DIM, generator=g) for _ in range(LAYERS)]
    return keys, values


def _put(store, ids, *, tenant="alice", model="src", seed=0):
    keys, values = _kv(len(ids), seed)
    store.put(isolation_key=tenant, source_model=model, token_ids=ids, keys=keys, values=values)
    return keys, values


def test_the_source_attention_stored_with_an_entry_reads_back_on_the_loaded_positions(tmp_path):
    store = KVStore(tmp_path, max_bytes=1 << 20, chunk_tokens=4)
    ids = list(range(1, 15))
    keys, values = _kv(len(ids))
    attention = torch.rand(5, len(ids), dtype=torch.float64)
    entry = store.put(
        isolation_key="alice", source_model="src", token_ids=ids, keys=keys, values=values, attention=attention
    )
    rows = store.read_attention(entry, token_ids=ids, end=8)
    assert rows.dtype == torch.float32 and rows.shape == (5, 14)  # over the whole entry: its length says whose question
    torch.testing.assert_close(rows, attention.float())
    assert store.read(entry, token_ids=ids, start=0, end=8)[0][0].shape == (1, HEADS, 8, DIM)  # KV as before
    plain = store.put(isolation_key="bob", source_model="src", token_ids=ids, keys=keys, values=values)
    assert store.read_attention(plain, token_ids=ids, end=8) is None  # stored without: the consumer falls back
    with pytest.raises(IncompatibleError, match="does not hold the first 8 tokens"):
        store.read_attention(entry, token_ids=[9] * 8, end=8)


@pytest.mark.parametrize(
    "attention, match",
    [
        (torch.rand(5, 13), "covers 13 tokens, the entry 14"),
        (torch.rand(14), r"\(queries, tokens\) tensor"),
        (torch.full((2, 14), float("nan")), "Inf/NaN or negative"),
        (-torch.rand(2, 14), "Inf/NaN or negative"),
    ],
)
def test_source_attention_of_the_wrong_shape_or_values_is_refused_on_put_and_nothing_is_stored(
    tmp_path, attention, match
):
    store = KVStore(tmp_path, max_bytes=1 << 20, chunk_tokens=4)
    keys, values = _kv(14)
    with pytest.raises(IncompatibleError, match=match):
        store.put(
            isolation_key="a",
            source_model="src",
            token_ids=list(range(14)),
            keys=keys,
            values=values,
            attention=attention,
        )
    assert store.total_bytes() == 0


def test_a_damaged_attention_tensor_on_disk_is_refused_on_read(tmp_path):
    """Another engine shares the directory: an entry whose attention was rewritten with the wrong width is
    IncompatibleError (the load falls back), never scores over positions it does not cover."""
    from safetensors.torch import load_file, save_file

    store = KVStore(tmp_path, max_bytes=1 << 20, chunk_tokens=4)
    ids = list(range(1, 15))
    keys, values = _kv(len(ids))
    entry = store.put(
        isolation_key="a", source_model="src", token_ids=ids, keys=keys, values=values, attention=torch.rand(3, 14)
    )
    tensors = load_file(entry)
    tensors["attention"] = torch.rand(3, 9)
    save_file(tensors, entry, metadata={"source_model": "src", "layers": str(LAYERS)})
    with pytest.raises(IncompatibleError, match="covers 9 tokens"):
        store.read_attention(entry, token_ids=ids, end=8)


def test_longest_prefix_is_chunk_aligned_and_reads_back_exact_rows(tmp_path):
    store = KVStore(tmp_path, max_bytes=1 << 20, chunk_tokens=4)
    ids = list(range(1, 15))  # 14 tokens: chunks end at 4, 8, 12
    keys, values = _put(store, ids)
    prompt = ids[:10] + [99, 98, 97]  # shares 10 tokens -> 8 chunk-aligned
    found = store.longest_prefix(isolation_key="alice", source_model="src", token_ids=prompt)
    assert found.tokens == 8
    assert store.longest_prefix(isolation_key="alice", source_model="src", token_ids=ids, max_tokens=11).tokens == 8
    assert store.longest_prefix(isolation_key="alice", source_model="src", token_ids=ids).tokens == 12
    got_k, got_v = KVStore.read(found.entry, token_ids=prompt, start=2, end=8)
    for l in range(LAYERS):
        assert got_k[l].shape == (1, HEADS, 6, DIM)
        assert torch.equal(got_k[l][0], keys[l][:, 2:8]) and torch.equal(got_v[l][0], values[l][:, 2:8])


def test_tenants_and_source_models_never_see_each_other(tmp_path):
    store = KVStore(tmp_path, max_bytes=1 << 20, chunk_tokens=4)
    ids = list(range(1, 13))
    _put(store, ids, tenant="alice", model="src")
    assert store.longest_prefix(isolation_key="bob", source_model="src", token_ids=ids) is None
    assert store.longest_prefix(isolation_key="", source_model="src", token_ids=ids) is None
    assert store.longest_prefix(isolation_key="alice", source_model="other", token_ids=ids) is None
    assert store.longest_prefix(isolation_key="alice", source_model="src", token_ids=ids) is not None
    assert KVStore.namespace("alice", "src") != KVStore.namespace("bob", "src")


def test_read_refuses_an_entry_holding_other_tokens(tmp_path):
    store = KVStore(tmp_path, max_bytes=1 << 20, chunk_tokens=4)
    ids = list(range(1, 13))
    _put(store, ids)
    entry = store.longest_prefix(isolation_key="alice", source_model="src", token_ids=ids).entry
    with pytest.raises(IncompatibleError, match="does not hold"):
        KVStore.read(entry, token_ids=[5] + ids[1:], start=0, end=8)


def test_size_cap_evicts_least_recently_used_and_its_index(tmp_path):
    ids = [list(range(100 * n + 1, 100 * n + 17)) for n in range(3)]
    probe = KVStore(tmp_path / "probe", max_bytes=1 << 30, chunk_tokens=4)
    _put(probe, ids[0])
    store = KVStore(tmp_path / "capped", max_bytes=int(2.5 * probe.total_bytes()), chunk_tokens=4)

    def entry(n):
        return store.longest_prefix(isolation_key="alice", source_model="src", token_ids=ids[n])

    _put(store, ids[0])
    _put(store, ids[1])
    oldest = entry(0).entry
    os.utime(oldest, (1e9, 1e9))
    os.utime(entry(1).entry, (2e9, 2e9))
    _put(store, ids[2])
    assert store.total_bytes() <= store.max_bytes
    assert entry(0) is None and entry(1) is not None and entry(2) is not None
    index = oldest.parent.parent / "index"
    assert len(list(index.iterdir())) == 2 * 4  # 4 chunk prefixes of each surviving entry, none of the evicted one


def test_a_pinned_entry_stays_readable_after_eviction(tmp_path):
    store = KVStore(tmp_path, max_bytes=1 << 20, chunk_tokens=4)
    ids = list(range(1, 13))
    keys, _ = _put(store, ids)
    found = store.longest_prefix(isolation_key="alice", source_model="src", token_ids=ids)
    pin = store.pin(found)
    KVStore(tmp_path, max_bytes=1, chunk_tokens=4).evict()  # a cap that nothing fits
    assert not found.entry.exists()
    assert store.longest_prefix(isolation_key="alice", source_model="src", token_ids=ids) is None
    got, _ = KVStore.read(pin, token_ids=ids, start=0, end=12)
    assert torch.equal(got[0][0], keys[0])
    KVStore.release(pin)
    assert not pin.exists()
    assert store.pin(found) is None  # the entry is gone: nothing to pin


def test_engines_must_agree_on_the_chunk_size(tmp_path):
    KVStore(tmp_path, max_bytes=1 << 20, chunk_tokens=16)
    with pytest.raises(ConfigError, match="chunk_tokens"):
        KVStore(tmp_path, max_bytes=1 << 20, chunk_tokens=32)


def test_short_prompts_are_not_stored(tmp_path):
    store = KVStore(tmp_path, max_bytes=1 << 20, chunk_tokens=16)
    keys, values = _kv(10)
    assert store.put(isolation_key="a", source_model="s", token_ids=list(range(10)), keys=keys, values=values) is None


# ---- a store directory written by someone else (reliability-2 R2, R3, R11, R19) ----------------------
def _bob_index(store, ids, count=-1):
    """Bob's index file of the prefix of ``ids`` (his namespace's directories made as a put would)."""
    namespace = KVStore.namespace("bob", "src")
    directory = store.root / "ns" / namespace
    for sub in ("entries", "index"):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    return directory / "index" / store.prefix_hashes(namespace, ids)[count]


@pytest.mark.parametrize("relative", [True, False], ids=["dot-dot-path", "absolute-path"])
def test_an_index_naming_another_tenants_entry_is_a_miss_and_is_removed(tmp_path, relative):
    store = KVStore(tmp_path, max_bytes=1 << 20, chunk_tokens=4)
    ids = list(range(1, 13))
    _put(store, ids, tenant="alice")
    alice = store.longest_prefix(isolation_key="alice", source_model="src", token_ids=ids).entry
    os.utime(alice, (1e9, 1e9))
    index = _bob_index(store, ids)
    escape = f"../../{alice.parent.parent.name}/entries/{alice.name}"
    index.write_text(escape if relative else str(alice))
    assert store.longest_prefix(isolation_key="bob", source_model="src", token_ids=ids) is None
    assert not index.exists()
    assert store.pin(StoredPrefix(index.parent.parent / "entries" / escape, 12)) is None
    assert list((tmp_path / "pins").iterdir()) == [] and alice.stat().st_mtime == 1e9


def test_a_symlinked_entry_is_refused_never_read_and_its_target_untouched(tmp_path):
    store = KVStore(tmp_path, max_bytes=1 << 20, chunk_tokens=4)
    ids = list(range(1, 13))
    _put(store, ids, tenant="alice")
    alice = store.longest_prefix(isolation_key="alice", source_model="src", token_ids=ids).entry
    os.utime(alice, (1e9, 1e9))
    index = _bob_index(store, ids)
    link = index.parent.parent / "entries" / alice.name
    link.symlink_to(alice)
    index.write_text(alice.name)
    assert store.longest_prefix(isolation_key="bob", source_model="src", token_ids=ids) is None
    assert store.pin(StoredPrefix(link, 12)) is None
    with pytest.raises(IncompatibleError, match="symbolic link"):
        KVStore.read(link, token_ids=ids, start=0, end=12)
    assert list((tmp_path / "pins").iterdir()) == []
    assert store.total_bytes() == alice.stat().st_size  # counted once; the link is swept away
    assert not os.path.lexists(link) and alice.stat().st_mtime == 1e9


def test_pin_never_links_a_file_outside_the_store(tmp_path):
    store = KVStore(tmp_path / "store", max_bytes=1 << 20, chunk_tokens=4)
    outside = tmp_path / "secret" / "entries" / f"{'a' * 40}-16.safetensors"  # named like an entry
    outside.parent.mkdir(parents=True)
    outside.write_bytes(b"secret")
    os.utime(outside, (1e9, 1e9))
    assert store.pin(StoredPrefix(outside, 16)) is None
    assert list((tmp_path / "store" / "pins").iterdir()) == [] and outside.stat().st_mtime == 1e9


def test_a_namespace_linked_out_of_the_store_is_neither_read_nor_evicted_from(tmp_path):
    store = KVStore(tmp_path / "store", max_bytes=1 << 20, chunk_tokens=4)
    ids = list(range(1, 13))
    _put(store, ids, tenant="alice")
    alice = store.longest_prefix(isolation_key="alice", source_model="src", token_ids=ids).entry
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "entries").mkdir(parents=True)
    (elsewhere / "index").mkdir()
    (elsewhere / "entries" / alice.name).write_bytes(alice.read_bytes())
    bob = KVStore.namespace("bob", "src")
    (elsewhere / "index" / store.prefix_hashes(bob, ids)[-1]).write_text(alice.name)
    (tmp_path / "store" / "ns" / bob).symlink_to(elsewhere, target_is_directory=True)
    assert store.longest_prefix(isolation_key="bob", source_model="src", token_ids=ids) is None
    KVStore(tmp_path / "store", max_bytes=1, chunk_tokens=4).evict()  # a cap nothing fits
    assert not alice.exists() and (elsewhere / "entries" / alice.name).exists()


@pytest.mark.parametrize("damage", [b"", b"garbage" * 10, None], ids=["empty", "garbage", "truncated"])
def test_eviction_removes_a_damaged_entry_and_later_puts_succeed(tmp_path, damage):
    store = KVStore(tmp_path, max_bytes=1 << 20, chunk_tokens=4)
    ids = [list(range(100 * n + 1, 100 * n + 17)) for n in range(3)]
    _put(store, ids[0])
    damaged = store.longest_prefix(isolation_key="alice", source_model="src", token_ids=ids[0]).entry
    size = damaged.stat().st_size
    damaged.write_bytes(damaged.read_bytes()[: size // 2] if damage is None else damage)
    os.utime(damaged, (1e9, 1e9))
    store = KVStore(tmp_path, max_bytes=int(1.5 * size), chunk_tokens=4)
    for prompt in ids[1:]:
        _put(store, prompt)
        assert store.longest_prefix(isolation_key="alice", source_model="src", token_ids=prompt) is not None
    assert not damaged.exists() and store.total_bytes() <= store.max_bytes
    index = damaged.parent.parent / "index"
    assert all(path.read_text() != damaged.name for path in index.iterdir())


def test_eviction_treats_an_entry_another_engine_removed_as_gone(tmp_path, monkeypatch):
    probe = KVStore(tmp_path / "probe", max_bytes=1 << 30, chunk_tokens=4)
    _put(probe, list(range(1, 17)))
    store = KVStore(tmp_path / "store", max_bytes=int(1.5 * probe.total_bytes()), chunk_tokens=4)
    _put(store, list(range(1, 17)))

    def removed_meanwhile(path):  # torch reopens the file by name after safetensors read its header
        path.unlink()
        raise RuntimeError(f"unable to open file <{path}> in read-only mode: No such file or directory (2)")

    monkeypatch.setattr(kvstore, "read_token_ids", removed_meanwhile)
    ids = list(range(101, 117))
    keys, _ = _put(store, ids, seed=1)
    found = store.longest_prefix(isolation_key="alice", source_model="src", token_ids=ids)
    assert torch.equal(KVStore.read(found.entry, token_ids=ids, start=0, end=16)[0][0][0], keys[0])
    assert store.total_bytes() <= store.max_bytes


def test_a_cap_below_one_entry_refuses_the_put_and_stores_nothing(tmp_path):
    store = KVStore(tmp_path, max_bytes=1000, chunk_tokens=4)
    with pytest.raises(ConfigError, match="raise kvstore_max_bytes"):
        _put(store, list(range(1, 17)))
    assert [p for p in tmp_path.rglob("*") if p.is_file() and p.name != "store.json"] == []


def test_the_entry_a_put_returns_is_not_its_own_eviction_victim(tmp_path):
    probe = KVStore(tmp_path / "probe", max_bytes=1 << 30, chunk_tokens=4)
    _put(probe, list(range(1, 17)))
    store = KVStore(tmp_path / "store", max_bytes=int(1.5 * probe.total_bytes()), chunk_tokens=4)
    _put(store, list(range(1, 17)))
    newer = store.longest_prefix(isolation_key="alice", source_model="src", token_ids=list(range(1, 17))).entry
    os.utime(newer, (4e9, 4e9))  # another engine's clock runs ahead
    keys, values = _kv(16)
    entry = store.put(
        isolation_key="alice", source_model="src", token_ids=list(range(101, 117)), keys=keys, values=values
    )
    assert entry.exists() and not newer.exists()


@pytest.mark.parametrize("where", ["entry", "index"])
def test_disk_full_during_put_is_a_kvstore_error_and_leaves_nothing(tmp_path, monkeypatch, where):
    import safetensors.torch
    from safetensors import SafetensorError

    store = KVStore(tmp_path, max_bytes=1 << 20, chunk_tokens=4)
    save_file, write_bytes = safetensors.torch.save_file, Path.write_bytes
    writes = []

    def full_entry(tensors, filename, metadata=None):
        save_file(tensors, filename, metadata=metadata)
        os.truncate(filename, 100)  # what was written before the disk filled up
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    def full_index(path, data):
        writes.append(path)
        if len(writes) == 3:
            write_bytes(path, data[:5])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return write_bytes(path, data)

    if where == "entry":
        monkeypatch.setattr(safetensors.torch, "save_file", full_entry)
    else:
        monkeypatch.setattr(Path, "write_bytes", full_index)
    with pytest.raises(KVStoreError, match="No space left on device.*nothing stored.*free space"):
        _put(store, list(range(1, 17)))
    assert [p for p in (tmp_path / "ns").rglob("*") if not p.is_dir()] == []


def test_a_read_only_store_directory_is_refused_at_start(tmp_path, monkeypatch):
    KVStore(tmp_path, max_bytes=1 << 20, chunk_tokens=4)
    real_open, real_mkdir = os.open, os.mkdir

    def read_only_open(path, flags, *args, **kwargs):
        if flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)

    def read_only_mkdir(path, *args, **kwargs):
        if not os.path.isdir(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only_open)
    monkeypatch.setattr(os, "mkdir", read_only_mkdir)
    with pytest.raises(ConfigError, match=f"cannot write the KV store directory {tmp_path}: Read-only.*write access"):
        KVStore(tmp_path, max_bytes=1 << 20, chunk_tokens=4)
    with pytest.raises(ConfigError, match="Read-only file system"):
        KVStore(tmp_path / "new", max_bytes=1 << 20, chunk_tokens=4)


@pytest.mark.parametrize(
    "prompt, computed, stored, expected",
    [
        (100, 0, 80, (0, 64)),  # min(80, 100 - 16) = 80 -> 64 with 32-token blocks
        (100, 32, 80, (32, 64)),  # vLLM's own exact prefix-cache hit is kept, only the rest is mapped
        (100, 64, 80, (64, 64)),  # nothing past the local hit
        (40, 0, 400, (0, 0)),  # the exact tail leaves less than a block
        (200, 0, 400, (0, 160)),  # the tail bounds it: 200 - 16 = 184 -> 160
    ],
)
def test_load_plan(prompt, computed, stored, expected):
    assert (
        load_plan(prompt_tokens=prompt, computed_tokens=computed, stored_tokens=stored, block_size=32, exact_suffix=16)
        == expected
    )


def test_load_plan_always_leaves_one_token_to_compute():
    assert load_plan(prompt_tokens=64, computed_tokens=0, stored_tokens=64, block_size=32, exact_suffix=0) == (0, 32)


# ---- paged layout ----------------------------------------------------------------------------------
def _transposed_key_writer(block_size, heads, dim):
    """A cache laid out like vLLM's CPU 'vec' kernel: (blocks, H, b, 2D) holding keys as (D, b) then values (b, D)."""

    def write(key, value, cache, slots):  # key, value: (N, H, D)
        view = cache.view(cache.shape[0], heads, 2 * block_size * dim)
        for n, slot in enumerate(slots.tolist()):
            block, offset = divmod(slot, block_size)
            for h in range(heads):
                keys = view[block, h, : block_size * dim].view(dim, block_size)
                keys[:, offset] = key[n, h]
                view[block, h, block_size * dim :].view(block_size, dim)[offset] = value[n, h]

    return write


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probe_finds_a_transposed_layout_and_gather_reads_tokens_back(dtype):
    block_size, heads, dim = 8, 2, 32
    writer = _transposed_key_writer(block_size, heads, dim)
    layout = probe_layout(
        writer,
        torch.zeros(1, heads, block_size, 2 * dim, dtype=dtype),
        block_size=block_size,
        heads=heads,
        head_dim=dim,
    )
    cache = torch.zeros(5, heads, block_size, 2 * dim, dtype=dtype)
    slots = torch.tensor([3 * 8 + 5, 3 * 8 + 6, 1 * 8 + 0, 4 * 8 + 7])
    key, value = torch.randn(4, heads, dim).to(dtype), torch.randn(4, heads, dim).to(dtype)
    writer(key, value, cache, slots)
    got_k, got_v = layout.gather(cache, slots)
    assert torch.equal(got_k, key.transpose(0, 1)) and torch.equal(got_v, value.transpose(0, 1))


def test_probe_refuses_a_writer_it_cannot_invert():
    def lossy(key, value, cache, slots):  # keeps only head 0
        cache.view(-1)[: key[:, 0].numel()] = key[:, 0].reshape(-1)

    with pytest.raises(UnsupportedModelError, match="cannot read this paged KV layout"):
        probe_layout(lossy, torch.zeros(1, 2, 4, 16), block_size=4, heads=2, head_dim=8)
