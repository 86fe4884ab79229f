"""A bounded, tenant-isolated store of source-model KV in a directory both engines can reach.

Layout under ``root`` (a local directory; under ``/dev/shm`` it is shared memory)::

    store.json                            {"format": 1, "chunk_tokens": C}
    ns/<namespace>/entries/<entry>.safetensors
                                          token_ids (T,) int64, keys.{l}, values.{l} (H, T, D)
    ns/<namespace>/index/<prefix hash>    text: the entry that holds that prefix
    pins/<name>.safetensors               hard links that keep an entry readable while a load uses it

namespace = sha256(isolation key, source model): one tenant's prompts live in a directory another
tenant's keys never name.  Prefix hashes chain over C-token chunks of the token ids, seeded with the
namespace, so the hash of the first j*C tokens is h_j = sha256(h_{j-1} || chunk_j), h_0 = namespace.
Every chunk-aligned prefix of an entry is indexed, so a prompt that extends a stored one finds it.

Bounds: after each write, entries are evicted, least recently used first (a read touches its entry),
until their bytes fit ``max_bytes``.  An entry's index files go with it; a reader that still finds a
stale one treats it as a miss.  Writes are atomic (temp file + rename), so a reader never sees half an
entry.  Entries are whole prompts of one source model, in the source engine's cache dtype.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from kvhub.errors import ConfigError, IncompatibleError

log = logging.getLogger(__name__)

FORMAT = 1
STALE_PIN_SECONDS = 600.0


@dataclass(frozen=True)
class StoredPrefix:
    """The longest stored prefix of a prompt: ``tokens`` tokens of ``entry``."""

    entry: Path
    tokens: int


class KVStore:
    """See the module docstring.  ``chunk_tokens`` must be the same for every engine sharing ``root``."""

    def __init__(self, root: str | os.PathLike, *, max_bytes: int, chunk_tokens: int = 16):
        if max_bytes <= 0:
            raise ConfigError(f"the KV store size cap must be positive, got {max_bytes} bytes")
        if chunk_tokens < 1:
            raise ConfigError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.root = Path(root)
        self.max_bytes = int(max_bytes)
        self.chunk_tokens = int(chunk_tokens)
        (self.root / "pins").mkdir(parents=True, exist_ok=True)
        self._check_format()

    def _check_format(self) -> None:
        path = self.root / "store.json"
        wanted = {"format": FORMAT, "chunk_tokens": self.chunk_tokens}
        if not path.exists():
            _atomic_write_bytes(path, json.dumps(wanted).encode())
        found = json.loads(path.read_text())
        if found != wanted:
            raise ConfigError(
                f"the KV store at {self.root} was created with {found}, this engine asks for {wanted}; "
                "give every engine the same chunk_tokens, or point this one at another store_dir"
            )

    # ---- keys ----------------------------------------------------------------------------------
    @staticmethod
    def namespace(isolation_key: str, source_model: str) -> str:
        """sha256 of (isolation key, source model): the directory of one tenant's prompts for one model."""
        text = json.dumps([isolation_key, source_model])
        return hashlib.sha256(text.encode()).hexdigest()[:40]

    def prefix_hashes(self, namespace: str, token_ids: list[int]) -> list[str]:
        """h_1..h_J of the J whole chunks of ``token_ids`` (module docstring)."""
        state = hashlib.sha256(namespace.encode()).digest()
        hashes = []
        for start in range(0, len(token_ids) - self.chunk_tokens + 1, self.chunk_tokens):
            chunk = torch.tensor(token_ids[start:start + self.chunk_tokens], dtype=torch.int64)
            state = hashlib.sha256(state + chunk.numpy().tobytes()).digest()
            hashes.append(state.hex()[:40])
        return hashes

    def _dir(self, namespace: str) -> Path:
        return self.root / "ns" / namespace

    # ---- writing -------------------------------------------------------------------------------
    def put(self, *, isolation_key: str, source_model: str, token_ids: list[int],
            keys: list[torch.Tensor], values: list[torch.Tensor]) -> Path | None:
        """Store one prompt's KV: keys[l], values[l] (H, T, D) for T = len(token_ids).

        Returns the entry, or None when the prompt is shorter than one chunk (nothing to index).
        """
        from safetensors.torch import save_file

        namespace = self.namespace(isolation_key, source_model)
        hashes = self.prefix_hashes(namespace, token_ids)
        if not hashes:
            return None
        for index, (k, v) in enumerate(zip(keys, values)):
            if k.dim() != 3 or k.shape != v.shape or k.shape[1] != len(token_ids):
                raise IncompatibleError(
                    f"layer {index}: keys {tuple(k.shape)} / values {tuple(v.shape)} do not cover "
                    f"{len(token_ids)} tokens as (heads, tokens, head_dim)"
                )
        directory = self._dir(namespace)
        (directory / "entries").mkdir(parents=True, exist_ok=True)
        (directory / "index").mkdir(parents=True, exist_ok=True)
        entry = directory / "entries" / f"{hashes[-1]}-{len(token_ids)}.safetensors"
        tensors = {"token_ids": torch.tensor(token_ids, dtype=torch.int64)}
        for index, (k, v) in enumerate(zip(keys, values)):
            tensors[f"keys.{index}"] = k.detach().to("cpu").contiguous()
            tensors[f"values.{index}"] = v.detach().to("cpu").contiguous()
        tmp = entry.with_name(f".{entry.name}.{uuid.uuid4().hex}.tmp")
        save_file(tensors, str(tmp), metadata={"source_model": source_model, "layers": str(len(keys))})
        os.replace(tmp, entry)
        for prefix in hashes:
            _atomic_write_bytes(directory / "index" / prefix, entry.name.encode())
        self.evict()
        return entry

    def evict(self) -> int:
        """Delete least recently used entries until the store fits ``max_bytes``; returns how many went."""
        entries = []
        for path in (self.root / "ns").glob("*/entries/*.safetensors"):
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            entries.append((stat.st_mtime, stat.st_size, path))
        total = sum(size for _, size, _ in entries)
        evicted = 0
        for _, size, path in sorted(entries, key=lambda item: item[0]):
            if total <= self.max_bytes:
                break
            self._remove_entry(path)
            total -= size
            evicted += 1
        if evicted:
            log.info("KV store %s: evicted %d entries to fit %d bytes", self.root, evicted, self.max_bytes)
        self._clean_pins()
        return evicted

    def _remove_entry(self, path: Path) -> None:
        namespace = path.parent.parent.name
        try:
            token_ids = _read_token_ids(path)
        except (OSError, ValueError):
            token_ids = []
        path.unlink(missing_ok=True)
        for prefix in self.prefix_hashes(namespace, token_ids):
            index = path.parent.parent / "index" / prefix
            try:
                if index.read_text() == path.name:
                    index.unlink(missing_ok=True)
            except FileNotFoundError:
                pass

    def _clean_pins(self) -> None:
        cutoff = time.time() - STALE_PIN_SECONDS
        for pin in (self.root / "pins").glob("*.safetensors"):
            try:
                if pin.stat().st_mtime < cutoff:
                    pin.unlink(missing_ok=True)
            except FileNotFoundError:
                pass

    # ---- reading -------------------------------------------------------------------------------
    def longest_prefix(self, *, isolation_key: str, source_model: str, token_ids: list[int],
                       max_tokens: int | None = None) -> StoredPrefix | None:
        """The longest chunk-aligned prefix of ``token_ids`` (at most ``max_tokens``) that is stored."""
        namespace = self.namespace(isolation_key, source_model)
        directory = self._dir(namespace)
        hashes = self.prefix_hashes(namespace, token_ids[:max_tokens] if max_tokens is not None else token_ids)
        for count in range(len(hashes), 0, -1):
            index = directory / "index" / hashes[count - 1]
            try:
                entry = directory / "entries" / index.read_text()
            except FileNotFoundError:
                continue
            if entry.exists():
                return StoredPrefix(entry, count * self.chunk_tokens)
            index.unlink(missing_ok=True)  # its entry was evicted
        return None

    def pin(self, prefix: StoredPrefix) -> Path | None:
        """A hard link to the entry that eviction cannot take away; None if the entry is already gone."""
        pin = self.root / "pins" / f"{uuid.uuid4().hex}.safetensors"
        try:
            os.link(prefix.entry, pin)
            os.utime(prefix.entry)  # a use: least recently used goes first
        except FileNotFoundError:
            return None
        return pin

    @staticmethod
    def release(pin: str | os.PathLike) -> None:
        Path(pin).unlink(missing_ok=True)

    @staticmethod
    def read(entry: str | os.PathLike, *, token_ids: list[int], start: int, end: int,
             device: torch.device | str = "cpu") -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Rows [start, end) of every layer: keys[l], values[l] (1, H, end - start, D) on ``device``.

        ``token_ids`` are the prompt's first ``end`` (or more) tokens; the entry must hold exactly them
        (IncompatibleError otherwise: a hash collision or a store written by something else).
        """
        from safetensors import safe_open

        with safe_open(str(entry), framework="pt") as f:
            stored = f.get_tensor("token_ids")
            if stored.shape[0] < end or stored[:end].tolist() != list(token_ids[:end]):
                raise IncompatibleError(f"KV store entry {entry} does not hold the first {end} tokens of this prompt")
            layers = int(f.metadata()["layers"])
            keys = [f.get_slice(f"keys.{l}")[:, start:end, :].unsqueeze(0).to(device) for l in range(layers)]
            values = [f.get_slice(f"values.{l}")[:, start:end, :].unsqueeze(0).to(device) for l in range(layers)]
        return keys, values

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in (self.root / "ns").glob("*/entries/*.safetensors"))


def _read_token_ids(path: Path) -> list[int]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor("token_ids").tolist()


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
