"""The files of the serving KV store (:mod:`kvhub.serving.kvstore`), read without trusting them.

The store's directory is shared with other engines, so every file in it is opened without following a
symbolic link and checked to be a regular file through the open descriptor:

- an entry, ``<h_J>-<T>.safetensors``: ``token_ids`` (T,) int64, ``keys.{l}`` and ``values.{l}`` (H, T, D)
  per layer, optionally ``attention`` (Q, T) float32 (the source model's attention of the prompt's last Q
  tokens on each of its T tokens, averaged over layers and heads: what the consumer's ``select=source``
  reads), and the metadata ``layers`` (their count) and ``source_model``;
- an index file: text that is the name of one entry;
- every write goes to a temp file renamed into place, so a reader never sees half a file, and a failed
  write becomes a KVStoreError with the fix its errno suggests.
"""

from __future__ import annotations

import errno
import logging
import operator
import os
import re
import stat
import uuid
from contextlib import contextmanager
from pathlib import Path

import torch

from kvhub.errors import ConfigError, IncompatibleError, KVStoreError

log = logging.getLogger("kvhub.serving.kvstore")

ENTRY_NAME = re.compile(r"[0-9a-f]{40}-([1-9][0-9]*)\.safetensors")  # what put names an entry: <h_J>-<T>
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # opening a FIFO planted in the store must not hang
READ_NO_FOLLOW = os.O_RDONLY | _NOFOLLOW | _NONBLOCK  # every open for reading in the store
_FD_DIR = "/proc/self/fd"  # where an open descriptor has a path safetensors can open (Linux)
_WRITE_HINTS = {
    errno.ENOSPC: "free space on its file system or lower kvstore_max_bytes",
    errno.EDQUOT: "free space on its file system or lower kvstore_max_bytes",
    errno.EROFS: "mount it read-write or point kvstore_dir at a writable directory",
    errno.EACCES: "give the serving user write access to it",
    errno.EPERM: "give the serving user write access to it",
}


# ---- entries -----------------------------------------------------------------------------------------
def token_tensor(token_ids) -> torch.Tensor:
    """(T,) int64 of token ids that are integers in int64 range (ConfigError otherwise)."""
    try:
        return torch.tensor([operator.index(t) for t in token_ids], dtype=torch.int64)
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise ConfigError(f"token ids must be a list of integers in int64 range ({exc})") from exc


def check_layers(keys, values, tokens: int) -> None:
    """One (keys, values) pair per layer, each (H, T, D) with T = ``tokens`` and keys.shape == values.shape."""
    if not isinstance(keys, (list, tuple)) or not isinstance(values, (list, tuple)):
        raise IncompatibleError("keys and values must be lists of tensors, one per layer")
    if len(keys) != len(values) or not keys:
        raise IncompatibleError(
            f"{len(keys)} layers of keys but {len(values)} layers of values; pass one "
            "(keys, values) pair per layer, at least one"
        )
    for index, (k, v) in enumerate(zip(keys, values)):
        if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
            raise IncompatibleError(
                f"layer {index}: keys and values must be tensors, got {type(k).__name__} / {type(v).__name__}"
            )
        if k.dim() != 3 or k.shape != v.shape or k.shape[1] != tokens:
            raise IncompatibleError(
                f"layer {index}: keys {tuple(k.shape)} / values {tuple(v.shape)} do not cover "
                f"{tokens} tokens as (heads, tokens, head_dim)"
            )
        if not (bool(torch.isfinite(k).all()) and bool(torch.isfinite(v).all())):
            raise IncompatibleError(
                f"layer {index}: the keys or values hold Inf/NaN; a damaged prefill is not "
                "stored (the load path would refuse it later anyway)"
            )


def check_attention(attention, tokens: int) -> torch.Tensor:
    """``attention`` as (Q, T) float32 on the CPU, T = ``tokens``, Q >= 1, finite and non-negative (attention
    probabilities), else IncompatibleError: what an entry may hold as ``attention``, checked on write and read."""
    if not isinstance(attention, torch.Tensor) or attention.dim() != 2 or attention.shape[0] < 1:
        shape = tuple(attention.shape) if isinstance(attention, torch.Tensor) else type(attention).__name__
        raise IncompatibleError(f"source attention must be a (queries, tokens) tensor, got {shape}")
    if attention.shape[1] != tokens:
        raise IncompatibleError(f"source attention covers {attention.shape[1]} tokens, the entry {tokens}")
    attention = attention.detach().to("cpu", torch.float32).contiguous()
    if not (bool(torch.isfinite(attention).all()) and bool((attention >= 0).all())):
        raise IncompatibleError("source attention holds Inf/NaN or negative values; not attention probabilities")
    return attention


def entry_tensors(token_ids, keys, values, attention=None) -> dict[str, torch.Tensor]:
    """The tensors of one entry, on the CPU; a tensor passed twice is copied (safetensors refuses shared memory)."""
    tensors = {"token_ids": token_tensor(token_ids)}
    if attention is not None:
        tensors["attention"] = check_attention(attention, len(tensors["token_ids"]))
    seen = set()
    for index, (k, v) in enumerate(zip(keys, values)):
        for name, tensor in ((f"keys.{index}", k), (f"values.{index}", v)):
            tensor = tensor.detach().to("cpu").contiguous()
            if tensor.data_ptr() in seen:
                tensor = tensor.clone()
            seen.add(tensor.data_ptr())
            tensors[name] = tensor
    return tensors


# ---- files -------------------------------------------------------------------------------------------
def names_entry_of(name: str, tokens: int) -> bool:
    """``name`` is an entry name (nothing else: no directory, no link target) of at least ``tokens`` tokens."""
    match = ENTRY_NAME.fullmatch(name)
    return match is not None and int(match.group(1)) >= tokens


def is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def scandir(path: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as items:
            return list(items)
    except (FileNotFoundError, NotADirectoryError):
        return []


def read_regular_file(path: Path, *, limit: int) -> bytes:
    """The first ``limit`` bytes of a regular file, opened without following a link."""
    fd = os.open(path, READ_NO_FOLLOW)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path} is not a regular file")
        return os.read(fd, limit)
    finally:
        os.close(fd)


def read_index(path: Path) -> str | None:
    """The text of an index file; None if there is none; "" if it is not a regular text file."""
    try:
        return read_regular_file(path, limit=256).decode("ascii")
    except FileNotFoundError:
        return None
    except (OSError, ValueError):  # a link (ELOOP), a FIFO, a directory, non-ASCII bytes
        return ""


@contextmanager
def open_entry(path: str | os.PathLike):
    """safe_open of an entry opened without following a link; IncompatibleError for a link or non-file."""
    from safetensors import safe_open

    try:
        fd = os.open(path, READ_NO_FOLLOW)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):
            raise IncompatibleError(f"KV store entry {path} is a symbolic link; refused") from exc
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise IncompatibleError(f"KV store entry {path} is not a regular file; refused")
        # through the descriptor, so a link swapped in after the check is never followed
        by_fd = f"{_FD_DIR}/{fd}" if os.path.isdir(_FD_DIR) else os.fspath(path)
        with safe_open(by_fd, framework="pt") as f:
            yield f
    finally:
        os.close(fd)


def entry_layers(f) -> int:
    """The layer count of an open entry, checked against the tensors it holds."""
    layers = int((f.metadata() or {})["layers"])
    wanted = {"token_ids"} | {f"{kind}.{l}" for kind in ("keys", "values") for l in range(layers)}
    if layers < 1 or set(f.keys()) - {"attention"} != wanted:
        raise ValueError(f"metadata says {layers} layers, tensors are {sorted(f.keys())[:8]}")
    return layers


@contextmanager
def open_prompt_entry(entry: str | os.PathLike, *, token_ids: list[int], end: int):
    """:func:`open_entry`, checked to hold exactly the prompt's first ``end`` tokens (IncompatibleError
    otherwise: a hash collision or a store written by something else).  Inside the block, safetensors,
    int() and torch errors of a foreign or damaged file become IncompatibleError too; a missing entry
    raises FileNotFoundError."""
    try:
        with open_entry(entry) as f:
            stored = f.get_tensor("token_ids")
            if stored.shape[0] < end or stored[:end].tolist() != list(token_ids[:end]):
                raise IncompatibleError(f"KV store entry {entry} does not hold the first {end} tokens of this prompt")
            yield f
    except (IncompatibleError, FileNotFoundError):
        raise
    except Exception as exc:  # safetensors, int() and torch errors of a foreign file
        raise IncompatibleError(
            f"KV store entry {entry} is damaged or not a kvhub entry "
            f"({type(exc).__name__}: {exc}); delete it, the store is only a cache"
        ) from exc


def read_attention(entry: str | os.PathLike, *, token_ids: list[int], end: int) -> torch.Tensor | None:
    """The source's attention stored with an entry: (Q, T) float32 on the CPU over the entry's T positions,
    query i being its token T - Q + i; None when the entry holds none.  ``token_ids`` are the prompt's
    first ``end`` tokens, which the entry must hold; a damaged attention tensor is IncompatibleError, like
    a damaged entry (:func:`open_prompt_entry`)."""
    with open_prompt_entry(entry, token_ids=token_ids, end=operator.index(end)) as f:
        if "attention" not in f.keys():
            return None
        return check_attention(f.get_tensor("attention"), f.get_slice("token_ids").get_shape()[0])


def read_token_ids(path: Path) -> list[int]:
    with open_entry(path) as f:
        return f.get_tensor("token_ids").tolist()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        unlink_quietly(tmp)
        raise


def probe_writable(root: Path) -> None:
    """OSError unless a file can be created in ``root`` (a read-only store fails here, not at the first put)."""
    probe = root / f".probe-{uuid.uuid4().hex}.tmp"
    os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    probe.unlink()


def unlink_quietly(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:  # a read-only file system says so even for a file that is not there
        if os.path.lexists(path):
            log.warning("KV store: cannot remove %s: %s", path, exc)


def write_error(root: Path, exc: Exception, doing: str) -> KVStoreError:
    """KVStoreError for a failed write, with the fix its errno suggests (safetensors puts it in the text)."""
    code = exc.errno if isinstance(exc, OSError) else None
    if code is None:
        found = re.search(r"os error (\d+)", str(exc))
        code = int(found.group(1)) if found else None
    reason = os.strerror(code) if code else f"{type(exc).__name__}: {exc}"
    hint = _WRITE_HINTS.get(code, "check the store directory")
    return KVStoreError(f"KV store {root}: {doing} failed ({reason}); nothing stored; {hint}")
