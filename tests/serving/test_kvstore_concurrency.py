"""Stress: 4 producer and 2 consumer processes on one KV store with a cap of a few entries.

Every tenant stores the same prompts (so only the namespace keeps them apart) with KV stamped with the
tenant: keys = tenant * 1e5 + token id, values = -keys.  Consumers look up a random tenant's prompt,
pin, read and check the stamp.  Checks: no put fails (in particular none whose entry was stored), no
read ever returns another tenant's rows, no exception escapes the store, the cap holds at the end.
KVHUB_STORE_STRESS_S sets the duration (default 60 s); slow, so ``pytest -m slow`` runs it.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import time
import traceback
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CHUNK, HEADS, DIM, LAYERS = 8, 2, 4, 2
BASE_TOKENS, MAX_TAIL, PROMPTS = 24, 16, 12
PRODUCERS, CONSUMERS = 4, 2


def _tenant(n: int) -> str:
    return f"tenant-{n}"


def _prompt(rng: random.Random) -> list[int]:
    """One of PROMPTS shared openings (3 chunks), then a random tail of 0..MAX_TAIL tokens."""
    first = 1000 + 40 * rng.randrange(PROMPTS)
    return list(range(first, first + BASE_TOKENS)) + [rng.randrange(1, 999) for _ in range(rng.randrange(MAX_TAIL + 1))]


def _stamp(tenant: int, token_ids):
    import torch

    return tenant * 100_000 + torch.tensor(token_ids, dtype=torch.float32)  # (T,), exact in float32


def _kv(tenant: int, token_ids: list[int]):
    stamp = _stamp(tenant, token_ids).view(1, -1, 1).expand(HEADS, -1, DIM)  # (H, T, D)
    keys = [stamp + 0.5 * layer for layer in range(LAYERS)]
    return keys, [-k for k in keys]


def _producer(root: str, cap: int, tenant: int, seconds: float, results) -> None:
    report = {"role": "producer", "puts": 0, "failures": [], "stored_but_failed": 0}
    try:
        from kvhub.serving.kvstore import KVStore

        store = KVStore(root, max_bytes=cap, chunk_tokens=CHUNK)
        rng = random.Random(tenant)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            ids = _prompt(rng)
            keys, values = _kv(tenant, ids)
            try:
                store.put(isolation_key=_tenant(tenant), source_model="src", token_ids=ids, keys=keys, values=values)
                report["puts"] += 1
            except Exception:  # noqa: BLE001 - every failure is reported to the test
                namespace = KVStore.namespace(_tenant(tenant), "src")
                name = f"{store.prefix_hashes(namespace, ids)[-1]}-{len(ids)}.safetensors"
                report["stored_but_failed"] += (Path(root) / "ns" / namespace / "entries" / name).exists()
                report["failures"].append(traceback.format_exc())
    except BaseException:  # noqa: BLE001
        report["failures"].append(traceback.format_exc())
    results.put(report)


def _consumer(root: str, cap: int, seed: int, seconds: float, results) -> None:
    report = {"role": "consumer", "lookups": 0, "hits": 0, "evicted_before_pin": 0, "wrong_tenant": [], "failures": []}
    try:
        import torch

        from kvhub.serving.kvstore import KVStore

        store = KVStore(root, max_bytes=cap, chunk_tokens=CHUNK)
        rng = random.Random(1000 + seed)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            tenant, ids = rng.randrange(PRODUCERS), _prompt(rng)
            try:
                report["lookups"] += 1
                found = store.longest_prefix(isolation_key=_tenant(tenant), source_model="src", token_ids=ids)
                if found is None:
                    continue
                pin = store.pin(found)
                if pin is None:
                    report["evicted_before_pin"] += 1
                    continue
                try:
                    keys, values = KVStore.read(pin, token_ids=ids, start=0, end=found.tokens)
                finally:
                    KVStore.release(pin)
                report["hits"] += 1
                want = _kv(tenant, ids[: found.tokens])
                if (
                    not all(torch.equal(k[0], w) for k, w in zip(keys + values, want[0] + want[1]))
                    or len(keys) != LAYERS
                ):
                    report["wrong_tenant"].append((tenant, str(found.entry), float(keys[0][0, 0, 0, 0])))
            except Exception:  # noqa: BLE001 - every failure is reported to the test
                report["failures"].append(traceback.format_exc())
    except BaseException:  # noqa: BLE001
        report["failures"].append(traceback.format_exc())
    results.put(report)


def test_producers_and_consumers_share_a_small_store(tmp_path):
    from kvhub.serving.kvstore import KVStore

    seconds = float(os.environ.get("KVHUB_STORE_STRESS_S", "60"))
    probe = KVStore(tmp_path / "probe", max_bytes=1 << 30, chunk_tokens=CHUNK)
    ids = list(range(BASE_TOKENS + MAX_TAIL))
    probe.put(isolation_key="x", source_model="src", token_ids=ids, keys=_kv(0, ids)[0], values=_kv(0, ids)[1])
    cap = 6 * probe.total_bytes()  # a few entries of the 4 tenants: eviction on nearly every put
    root = str(tmp_path / "store")
    KVStore(root, max_bytes=cap, chunk_tokens=CHUNK)

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    workers = [context.Process(target=_producer, args=(root, cap, n, seconds, results)) for n in range(PRODUCERS)]
    workers += [context.Process(target=_consumer, args=(root, cap, n, seconds, results)) for n in range(CONSUMERS)]
    for worker in workers:
        worker.start()
    reports = [results.get(timeout=seconds + 180) for _ in workers]
    for worker in workers:
        worker.join(timeout=30)

    failures = [text for report in reports for text in report["failures"]]
    assert failures == [], failures[:3]
    producers = [r for r in reports if r["role"] == "producer"]
    consumers = [r for r in reports if r["role"] == "consumer"]
    assert sum(r["stored_but_failed"] for r in producers) == 0
    assert [w for r in consumers for w in r["wrong_tenant"]] == []
    assert all(r["puts"] > 0 for r in producers) and sum(r["hits"] for r in consumers) > 0, reports
    store = KVStore(root, max_bytes=cap, chunk_tokens=CHUNK)
    assert store.total_bytes() <= cap
    assert [p for p in Path(root).rglob("*.tmp")] == []  # every put finished its temp files
    assert list((Path(root) / "pins").iterdir()) == []  # every pin released
    print({key: sum(r.get(key, 0) for r in reports) for key in ("puts", "lookups", "hits", "evicted_before_pin")})
