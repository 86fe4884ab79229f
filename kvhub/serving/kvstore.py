"""A bounded, tenant-isolated store of source-model KV in a directory both engines can reach.

Layout under ``root`` (a local directory; under ``/dev/shm`` it is shared memory)::

    store.json                            {"format": 1, "chunk_tokens": C}
    ns/<namespace>/entries/<entry>        <entry> = <h_J>-<T>.safetensors:
                                          token_ids (T,) int64, keys.{l}, values.{l} (H, T, D)
    ns/<namespace>/index/<prefix hash>    text: the name of the entry (in the same namespace) that holds that prefix
    pins/<name>.safetensors               hard links that keep an entry readable while a load uses it

namespace = sha256(isolation key, source model): one tenant's prompts live in a directory another
tenant's keys never name.  Prefix hashes chain over C-token chunks of the token ids, seeded with the
namespace, so the hash of the first j*C tokens is h_j = sha256(h_{j-1} || chunk_j), h_0 = namespace.
Every chunk-aligned prefix of an entry is indexed, so a prompt that extends a stored one finds it.

Trust: the directory is shared, so nothing read from it is taken on faith.  An index file counts only
if it is a regular file whose whole text is an entry name of the form above; it is resolved in the
caller's own ``entries/`` and nowhere else.  Entries, pins and index files are opened without following
symbolic links, and a namespace, ``entries/``, ``index/`` or ``pins/`` that is a link is not used.
A bad index file is a miss (and is removed); a linked entry is a miss (and eviction removes the link).

Bounds: after each write, entries are evicted, least recently used first (a pin touches its entry),
until their bytes fit ``max_bytes``; the entry a put has just written is never that put's own victim,
and an entry larger than ``max_bytes`` is refused (ConfigError) rather than written and dropped.  An
entry's index files go with it; a reader that still finds a stale one treats it as a miss.  Eviction
removes a damaged entry, or one another engine removed first, like any other.  Writes are atomic
(temp file + rename), so a reader never sees half an entry; a failed write (disk full, read-only)
raises KVStoreError and leaves nothing behind.  Entries are whole prompts of one source model, in the
source engine's cache dtype.  Reading and writing the files themselves, without trusting them, is
:mod:`kvhub.serving.kvstore_files`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import operator
import os
import re
import stat
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from kvhub.errors import ConfigError, KVStoreError
from kvhub.serving.kvstore_files import (
    ENTRY_NAME,
    READ_NO_FOLLOW,
    atomic_write_bytes,
    check_layers,
    entry_layers,
    entry_tensors,
    is_real_dir,
    names_entry_of,
    open_prompt_entry,
    probe_writable,
    read_attention,
    read_index,
    read_regular_file,
    read_token_ids,
    scandir,
    token_tensor,
    unlink_quietly,
    write_error,
)

log = logging.getLogger(__name__)

FORMAT = 1
STALE_PIN_SECONDS = 600.0
_NAMESPACE = re.compile(r"[0-9a-f]{40}")
_PIN_NAME = re.compile(r"[0-9a-f]{32}\.safetensors")


@dataclass(frozen=True)
class StoredPrefix:
    """The longest stored prefix of a prompt: ``tokens`` tokens of ``entry``."""

    entry: Path
    tokens: int


class KVStore:
    """See the module docstring.  ``chunk_tokens`` must be the same for every engine sharing ``root``.

    Construction refuses (ConfigError, naming the directory and the fix) a ``root`` that is not a
    writable directory or whose ``store.json`` is damaged.
    """

    def __init__(self, root: str | os.PathLike, *, max_bytes: int, chunk_tokens: int = 16):
        self.max_bytes = _whole_number(max_bytes, "the KV store size cap (kvstore_max_bytes)", minimum=1)
        self.chunk_tokens = _whole_number(chunk_tokens, "chunk_tokens", minimum=1)
        if not isinstance(root, (str, os.PathLike)) or not os.fspath(root):
            raise ConfigError(f"the KV store directory must be a non-empty path, got {root!r}")
        self.root = Path(root)
        try:
            (self.root / "pins").mkdir(parents=True, exist_ok=True)
            self._check_format()
            probe_writable(self.root)
            if not is_real_dir(self.root / "pins"):
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(self.root / "pins"))
        except (FileExistsError, NotADirectoryError) as exc:
            raise ConfigError(
                f"the KV store directory {self.root} is not a directory ({exc.filename} is in the way); "
                "point kvstore_dir at a directory, or move that file away"
            ) from exc
        except OSError as exc:
            raise ConfigError(
                f"cannot write the KV store directory {self.root}: {exc.strerror or exc}; both engines write "
                "there (entries, index files, pins), so give the serving user write access to it or point "
                "kvstore_dir at a writable directory"
            ) from exc

    def _check_format(self) -> None:
        path = self.root / "store.json"
        wanted = {"format": FORMAT, "chunk_tokens": self.chunk_tokens}
        if not os.path.lexists(path):
            atomic_write_bytes(path, json.dumps(wanted).encode())
        found = self._read_format(path)
        if found != wanted:
            raise ConfigError(
                f"the KV store at {self.root} was created with {found}, this engine asks for {wanted}; "
                "give every engine the same chunk_tokens, or point this one at another kvstore_dir"
            )

    def _read_format(self, path: Path) -> object:
        """The JSON in store.json; ConfigError if it is not a regular file of JSON text."""
        try:
            return json.loads(read_regular_file(path, limit=4096))
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.EMLINK):
                raise
            reason, cause = "a symbolic link", exc
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, not a regular file
            reason, cause = str(exc), exc
        raise ConfigError(
            f"the KV store's {path} is damaged ({reason}); remove it (the next engine writes a fresh one) "
            "or point kvstore_dir at another directory"
        ) from cause

    # ---- keys ----------------------------------------------------------------------------------
    @staticmethod
    def namespace(isolation_key: str, source_model: str) -> str:
        """sha256 of (isolation key, source model): the directory of one tenant's prompts for one model."""
        for name, value in (("isolation_key", isolation_key), ("source_model", source_model)):
            if not isinstance(value, str):
                raise ConfigError(f"{name} must be a string, got {type(value).__name__} {value!r}")
        text = json.dumps([isolation_key, source_model])
        return hashlib.sha256(text.encode()).hexdigest()[:40]

    def prefix_hashes(self, namespace: str, token_ids: list[int]) -> list[str]:
        """h_1..h_J of the J whole chunks of ``token_ids`` (module docstring)."""
        data = token_tensor(token_ids).numpy().tobytes()  # (T,) int64, native byte order
        step = 8 * self.chunk_tokens
        state = hashlib.sha256(namespace.encode()).digest()
        hashes = []
        for start in range(0, len(data) - step + 1, step):
            state = hashlib.sha256(state + data[start : start + step]).digest()
            hashes.append(state.hex()[:40])
        return hashes

    def _dir(self, namespace: str) -> Path:
        return self.root / "ns" / namespace

    def _namespace_dirs(self, namespace: str) -> tuple[Path, Path] | None:
        """(entries/, index/) of a namespace if both are real directories; None if missing or a link."""
        directory = self._dir(namespace)
        paths = (self.root / "ns", directory, directory / "entries", directory / "index")
        if all(is_real_dir(path) for path in paths):
            return paths[2], paths[3]
        if any(os.path.islink(path) for path in paths):
            log.warning("KV store %s: a directory of namespace %s is a symbolic link; not used", self.root, namespace)
        return None

    # ---- writing -------------------------------------------------------------------------------
    def put(
        self,
        *,
        isolation_key: str,
        source_model: str,
        token_ids: list[int],
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        attention: torch.Tensor | None = None,
    ) -> Path | None:
        """Store one prompt's KV: keys[l], values[l] (H, T, D) for T = len(token_ids), one pair per layer, and
        optionally the source's ``attention`` (Q, T) of the prompt's last Q tokens (:meth:`read_attention`).

        Returns the entry, or None when the prompt is shorter than one chunk (nothing to index).
        IncompatibleError for keys and values that do not pair up; ConfigError for an entry larger than
        ``max_bytes`` (nothing stored: raise kvstore_max_bytes); KVStoreError when the write fails (disk
        full, read-only; nothing stored).  Another engine's put may evict the entry any time after.
        """
        namespace = self.namespace(isolation_key, source_model)
        hashes = self.prefix_hashes(namespace, token_ids)
        check_layers(keys, values, len(token_ids))
        if not hashes:
            return None
        directory = self._dir(namespace)
        try:
            (directory / "entries").mkdir(parents=True, exist_ok=True)
            (directory / "index").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise write_error(self.root, exc, "creating a namespace directory") from exc
        dirs = self._namespace_dirs(namespace)
        if dirs is None:
            raise KVStoreError(
                f"KV store {self.root}: {directory} or a directory in it is not a plain directory "
                "(a symbolic link?); nothing stored; remove it, the next put recreates it"
            )
        entry = dirs[0] / f"{hashes[-1]}-{len(token_ids)}.safetensors"
        self._write_entry(
            entry,
            entry_tensors(token_ids, keys, values, attention),
            metadata={"source_model": source_model, "layers": str(len(keys))},
        )
        try:
            for prefix in hashes:
                atomic_write_bytes(dirs[1] / prefix, entry.name.encode())
        except OSError as exc:
            try:
                self._remove_entry(entry, prefixes=hashes)
            except OSError as cleanup:
                log.warning("KV store %s: cannot remove %s after a failed put: %s", self.root, entry, cleanup)
            raise write_error(self.root, exc, "writing an index file") from exc
        try:
            self._evict(keep=entry)
        except OSError as exc:  # the entry is stored; eviction is retried by the next put
            log.warning("KV store %s: eviction failed: %s", self.root, exc)
        return entry

    def _write_entry(self, entry: Path, tensors: dict[str, torch.Tensor], *, metadata: dict[str, str]) -> None:
        """Write ``entry`` atomically, or raise and leave nothing behind."""
        from safetensors.torch import save_file

        tmp = entry.with_name(f".{entry.name}.{uuid.uuid4().hex}.tmp")
        try:
            try:
                save_file(tensors, str(tmp), metadata=metadata)
                size = os.stat(tmp).st_size
            except Exception as exc:  # safetensors reports I/O errors as SafetensorError
                raise write_error(self.root, exc, "writing an entry") from exc
            if size > self.max_bytes:
                raise ConfigError(
                    f"a KV store entry for {len(tensors['token_ids'])} tokens takes {size} bytes, more than the "
                    f"size cap of {self.max_bytes} bytes of {self.root}; nothing stored; raise kvstore_max_bytes"
                )
            try:
                os.replace(tmp, entry)
            except OSError as exc:
                raise write_error(self.root, exc, "writing an entry") from exc
        except BaseException:
            unlink_quietly(tmp)
            raise

    def evict(self) -> int:
        """Delete least recently used entries until the store fits ``max_bytes``; returns how many went."""
        return self._evict(keep=None)

    def _evict(self, *, keep: Path | None) -> int:
        entries = [(st.st_mtime, st.st_size, path) for path, st in self._entries()]
        total = sum(size for _, size, _ in entries)
        evicted = 0
        for _, size, path in sorted(entries, key=lambda item: item[0]):
            if total <= self.max_bytes:
                break
            if path == keep:
                continue
            try:
                self._remove_entry(path)
            except OSError as exc:
                log.warning("KV store %s: cannot evict %s: %s", self.root, path, exc)
                continue
            total -= size
            evicted += 1
        if evicted:
            log.info("KV store %s: evicted %d entries to fit %d bytes", self.root, evicted, self.max_bytes)
        self._clean_pins()
        return evicted

    def _entries(self) -> Iterator[tuple[Path, os.stat_result]]:
        """(path, lstat) of every entry: regular files named like one, in real namespace directories.

        Symbolic links named like an entry are removed (put never makes one); temp files of puts that
        died are removed once stale.  Nothing outside ``root`` is ever looked into.
        """
        stale = time.time() - STALE_PIN_SECONDS
        for namespace in scandir(self.root / "ns"):
            if not (_NAMESPACE.fullmatch(namespace.name) and namespace.is_dir(follow_symlinks=False)):
                continue
            directory = Path(namespace.path) / "entries"
            if not is_real_dir(directory):
                continue
            for item in scandir(directory):
                try:
                    st = item.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if ENTRY_NAME.fullmatch(item.name) and stat.S_ISREG(st.st_mode):
                    yield Path(item.path), st
                elif ENTRY_NAME.fullmatch(item.name) and stat.S_ISLNK(st.st_mode):
                    log.warning("KV store %s: %s is a symbolic link, not an entry; removed", self.root, item.path)
                    unlink_quietly(Path(item.path))
                elif item.name.endswith(".tmp") and stat.S_ISREG(st.st_mode) and st.st_mtime < stale:
                    unlink_quietly(Path(item.path))

    def _remove_entry(self, path: Path, *, prefixes: list[str] | None = None) -> None:
        """Unlink an entry and the index files that name it.  A damaged entry goes all the same; one
        that is already gone was removed, index files included, by whoever removed it."""
        index_dir = path.parent.parent / "index"
        if prefixes is None:
            try:
                prefixes = self.prefix_hashes(path.parent.parent.name, read_token_ids(path))
            except FileNotFoundError:
                return
            except Exception as exc:  # noqa: BLE001 - a damaged entry must not stop eviction
                log.warning("KV store %s: removing unreadable entry %s (%s)", self.root, path, exc)
                prefixes = [item.name for item in scandir(index_dir) if not item.name.endswith(".tmp")]
        path.unlink(missing_ok=True)
        for prefix in prefixes:
            index = index_dir / prefix
            if read_index(index) == path.name:
                unlink_quietly(index)

    def _clean_pins(self) -> None:
        if not is_real_dir(self.root / "pins"):
            return
        cutoff = time.time() - STALE_PIN_SECONDS
        for pin in scandir(self.root / "pins"):
            try:
                if _PIN_NAME.fullmatch(pin.name) and pin.stat(follow_symlinks=False).st_mtime < cutoff:
                    unlink_quietly(Path(pin.path))
            except FileNotFoundError:
                pass

    # ---- reading -------------------------------------------------------------------------------
    def longest_prefix(
        self, *, isolation_key: str, source_model: str, token_ids: list[int], max_tokens: int | None = None
    ) -> StoredPrefix | None:
        """The longest chunk-aligned prefix of ``token_ids`` (at most ``max_tokens``) that is stored.

        Only entries of this (isolation key, source model) namespace are ever returned; a bad index
        file (one that names anything but an entry of this namespace) is a miss and is removed.
        """
        namespace = self.namespace(isolation_key, source_model)
        if max_tokens is not None:
            token_ids = token_ids[: max(0, _integer(max_tokens, "max_tokens"))]
        hashes = self.prefix_hashes(namespace, token_ids)
        dirs = self._namespace_dirs(namespace) if hashes else None
        if dirs is None:
            return None
        entries, index_dir = dirs
        for count in range(len(hashes), 0, -1):
            index = index_dir / hashes[count - 1]
            name = read_index(index)
            if name is None:
                continue
            if not names_entry_of(name, count * self.chunk_tokens):
                log.warning(
                    "KV store %s: index file %s names %r, not an entry of its namespace; removed",
                    self.root,
                    index,
                    name[:100],
                )
                unlink_quietly(index)
                continue
            try:
                mode = os.lstat(entries / name).st_mode
            except FileNotFoundError:
                mode = None  # its entry was evicted
            if mode is not None and stat.S_ISREG(mode):
                return StoredPrefix(entries / name, count * self.chunk_tokens)
            if mode is not None:
                log.warning("KV store %s: entry %s is not a regular file; not used", self.root, entries / name)
            unlink_quietly(index)
        return None

    def pin(self, prefix: StoredPrefix) -> Path | None:
        """A hard link to the entry that eviction cannot take away, and a use of the entry (LRU).

        None if the entry is already gone, or is not a regular file inside this store's namespaces
        (nothing is linked then), or the link cannot be made (logged).
        """
        entry = Path(prefix.entry)
        if not self._is_entry_path(entry):
            log.warning("KV store %s: refusing to pin %s: not an entry of this store", self.root, entry)
            return None
        pin = self.root / "pins" / f"{uuid.uuid4().hex}.safetensors"
        try:
            if not stat.S_ISREG(os.lstat(entry).st_mode):
                return None
            os.link(entry, pin, follow_symlinks=False)
            fd = os.open(pin, READ_NO_FOLLOW)  # the entry may have been swapped since
        except FileNotFoundError:
            unlink_quietly(pin)
            return None
        except OSError as exc:
            log.warning("KV store %s: cannot pin %s: %s", self.root, entry, exc)
            unlink_quietly(pin)
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                unlink_quietly(pin)
                return None
            os.utime(fd)  # a use: least recently used goes first
        finally:
            os.close(fd)
        return pin

    def _is_entry_path(self, entry: Path) -> bool:
        """``entry`` is root/ns/<namespace>/entries/<entry name> with every directory a real one."""
        namespace = entry.parent.parent
        return (
            bool(ENTRY_NAME.fullmatch(entry.name))
            and entry.parent.name == "entries"
            and bool(_NAMESPACE.fullmatch(namespace.name))
            and namespace.parent == self.root / "ns"
            and self._namespace_dirs(namespace.name) is not None
            and is_real_dir(self.root / "pins")
        )

    @staticmethod
    def release(pin: str | os.PathLike) -> None:
        """Remove a pin made by :meth:`pin`; anything that is not a pin file is left alone (logged)."""
        path = Path(pin)
        if not (_PIN_NAME.fullmatch(path.name) and path.parent.name == "pins"):
            log.warning("KV store: not releasing %s: not a pin", path)
            return
        path.unlink(missing_ok=True)

    @staticmethod
    def read(
        entry: str | os.PathLike, *, token_ids: list[int], start: int, end: int, device: torch.device | str = "cpu"
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Rows [start, end) of every layer: keys[l], values[l] (1, H, end - start, D) on ``device``.

        ``token_ids`` are the prompt's first ``end`` (or more) tokens; the entry must hold exactly them
        (IncompatibleError otherwise: a hash collision or a store written by something else).  A
        symbolic link or a damaged entry is refused with IncompatibleError; a missing one raises
        FileNotFoundError.
        """
        start, end = _integer(start, "start"), _integer(end, "end")
        if not 0 <= start <= end:
            raise ConfigError(f"rows [{start}, {end}) of a KV store entry: need 0 <= start <= end")
        with open_prompt_entry(entry, token_ids=token_ids, end=end) as f:
            layers = entry_layers(f)
            keys = [f.get_slice(f"keys.{l}")[:, start:end, :].unsqueeze(0).to(device) for l in range(layers)]
            values = [f.get_slice(f"values.{l}")[:, start:end, :].unsqueeze(0).to(device) for l in range(layers)]
        return keys, values

    read_attention = staticmethod(read_attention)  # the source attention stored with an entry, or None

    def total_bytes(self) -> int:
        return sum(st.st_size for _, st in self._entries())


# ---- checks on what callers pass ---------------------------------------------------------------------
def _whole_number(value, name: str, *, minimum: int) -> int:
    try:
        number = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        number = None
    if number is None or number < minimum:
        raise ConfigError(f"{name} must be a whole number >= {minimum}, got {value!r}")
    return number


def _integer(value, name: str) -> int:
    try:
        return operator.index(value)
    except TypeError as exc:
        raise ConfigError(f"{name} must be an integer, got {value!r}") from exc
