"""mapper.safetensors: the tensor names and shapes of every map structure, checked against the file's
own header (parsed here, never trusted from mapper.json), and its bytes scanned for NaN/Inf.

Per target layer m (d_in = k * Hs * Ds over the layer's k sources, d_out = Ht * Dt), for kind in k, v:

    {kind}.{m}.bias           (d_out,)
    {kind}.{m}.weight         (d_in, d_out)                          dense
                              (G, d_in / G, d_out / G)               head-local, G head groups
    {kind}.{m}.weight_a/_b    (d_in, R), (R, d_out)                  low rank R
                              (G, d_in / G, R), (G, R, d_out / G)    both
    {kind}.{m}.target_mean    (d_out,)   optional: the calibration mean of the target's K~ / V
    {kind}.{m}.mlp.{i}.*      the residual MLP of an ``mlp`` map (kvhub.artifact.kinds; format version 4)

All fp32 (``F32``).  G divides both KV head counts; format version 2 is required when any map is
head-local or low rank, and version 3 is written whenever ``target_mean`` tensors are stored (kvhub
0.1 read only the tensors it knew and refused the others as corrupt; version 3 makes it say "upgrade
kvhub" instead).  Artifacts written before version 3 that carry ``target_mean`` under version 1 or 2
are still read.  The tensors alone say which structure a map has (a fit may store densely a
map whose rank would save nothing); mapper.json's ``structure`` records what was asked for.  Nothing
here imports torch (numpy scans the bytes).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field

from kvhub.errors import InvalidArtifactError
from kvhub.artifact.files import open_regular
from kvhub.artifact.kinds import is_kind_part, kind_of, kind_of_part
from kvhub.artifact.metadata import parse_json

DTYPE = "F32"
HEADER_LIMIT = 100 << 20  # safetensors' own cap on the JSON header
_CHUNK = 4 << 20  # a multiple of 4: chunks hold whole fp32 values
_SUFFIXES = ("bias", "weight", "weight_a", "weight_b", "target_mean")


@dataclass
class TensorFile:
    """What the header of a tensor file says, and what scanning its bytes found."""

    shapes: dict[str, tuple[int, ...]]
    sha256: str | None = None
    nonfinite: list[str] = field(default_factory=list)  # tensors holding NaN or Inf


def read_tensor_file(path, *, scan: bool = True, where: str = "") -> TensorFile:
    """Parse the safetensors header of ``path`` (a regular file, never a link) and validate it: every
    tensor F32, offsets contiguous and covering the data exactly.  ``scan``: also hash the whole file
    and find the tensors holding NaN or Inf, in the same pass.  InvalidArtifactError otherwise."""
    where = where or str(path)
    with open_regular(path) as handle:
        size = os.fstat(handle.fileno()).st_size
        head = handle.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 2 <= length <= min(HEADER_LIMIT, size - 8):
            _fail(where, f"is not a safetensors file (header length {length}, file size {size})")
        raw = handle.read(length)
        try:
            header = parse_json(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            _fail(where, f"has a safetensors header that is not valid JSON ({exc})")
        entries = _entries(header, size - 8 - length, where)
        result = TensorFile({name: entry[1] for name, entry in entries.items()})
        if scan:
            digest = hashlib.sha256(head + raw)
            result.nonfinite = _scan(handle, digest, entries)
            result.sha256 = digest.hexdigest()
    return result


def _entries(header, data_bytes: int, where: str) -> dict[str, tuple[int, tuple[int, ...], int]]:
    """{name: (begin, shape, end)} of a parsed header, checked; sorted by offset."""
    if not isinstance(header, dict):
        _fail(where, "has a safetensors header that is not a JSON object")
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":  # safetensors itself refuses anything but {string: string} at load
            if info is not None and not (isinstance(info, dict) and all(isinstance(v, str) for v in info.values())):
                _fail(
                    where, f"has a safetensors __metadata__ that is not an object of strings ({json.dumps(info)[:60]})"
                )
            continue
        ok = (
            isinstance(info, dict)
            and isinstance(info.get("shape"), list)
            and isinstance(info.get("data_offsets"), list)
        )
        numbers = (
            ok
            and all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0
                for x in [*info["shape"], *info["data_offsets"]]
            )
            and len(info["data_offsets"]) == 2
        )
        if not numbers:
            _fail(where, f"has a malformed header entry for tensor {name!r}")
        if info.get("dtype") != DTYPE:
            _fail(where, f"stores tensor {name!r} as {info.get('dtype')!r}; the format stores fp32 ({DTYPE})")
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end - begin != 4 * math.prod(shape):
            _fail(where, f"gives tensor {name!r} of shape {shape} {end - begin} bytes, not {4 * math.prod(shape)}")
        entries[name] = (begin, shape, end)
    entries = dict(sorted(entries.items(), key=lambda item: (item[1][0], item[1][2])))
    position = 0
    for name, (begin, _, end) in entries.items():
        if begin != position:
            _fail(where, f"has overlapping or gapped data offsets at tensor {name!r}")
        position = end
    if position != data_bytes:
        _fail(where, f"has {data_bytes} data bytes but its header describes {position} (truncated or padded)")
    return entries


def _scan(handle, digest, entries) -> list[str]:
    """Hash the rest of the file into ``digest``; the names of tensors holding a non-finite value."""
    import numpy as np

    bad_offsets = []
    offset = 0
    while chunk := handle.read(_CHUNK):
        digest.update(chunk)
        values = np.frombuffer(chunk[: len(chunk) - len(chunk) % 4], dtype="<f4")
        finite = np.isfinite(values)
        if not finite.all():
            bad_offsets += [offset + 4 * int(i) for i in np.flatnonzero(~finite)[:1024]]
        offset += len(chunk)
    return sorted({name for name, (begin, _, end) in entries.items() for o in bad_offsets if begin <= o < end})


def map_prefix(kind: str, target: int) -> str:
    """``k.3``: the name prefix of target layer 3's key map (kind ``k``) or value map (``v``)."""
    if kind not in ("k", "v"):
        raise ValueError(f"a map's kind is 'k' or 'v', not {kind!r}")
    return f"{kind}.{target}"


def tensor_name(prefix: str, part: str) -> str:
    """``k.3.weight_a``: a map's tensor; ``part`` one of bias, weight, weight_a, weight_b, target_mean, or a
    part a map kind declares (``mlp.0.weight``, kvhub.artifact.kinds)."""
    if part not in _SUFFIXES and not is_kind_part(part):
        raise ValueError(f"a map's tensors are {', '.join(_SUFFIXES)} or a map kind's parts, not {part!r}")
    return f"{prefix}.{part}"


def _part(name: str) -> str:
    """``mlp.0.weight`` of ``k.3.mlp.0.weight``: a tensor name without its map prefix."""
    pieces = name.split(".", 2)
    return pieces[2] if len(pieces) == 3 else name


def is_compressed(shapes: dict[str, tuple[int, ...]]) -> bool:
    """True when some map is low rank (``weight_a``) or head-local (a 3-D ``weight``)."""
    return any(
        name.endswith(".weight_a") or (name.endswith(".weight") and len(shape) == 3) for name, shape in shapes.items()
    )


def has_target_means(shapes: dict[str, tuple[int, ...]]) -> bool:
    """True when some map stores its ``target_mean`` (the control of evaluations, kvhub.core.control)."""
    return any(name.endswith(".target_mean") for name in shapes)


def format_version_of(shapes: dict[str, tuple[int, ...]]) -> int:
    """The format version an artifact with these tensors declares: 1 for dense maps only (readable by
    every kvhub), 2 when a head-local or low-rank map is stored, 3 when ``target_mean`` tensors are, and
    a map kind's own version when its tensors are (4 for ``mlp``, kvhub.artifact.kinds)."""
    kinds = {kind for kind in (kind_of_part(_part(name)) for name in shapes) if kind is not None}
    linear = 3 if has_target_means(shapes) else 2 if is_compressed(shapes) else 1
    return max([linear, *(kind.format_version for kind in kinds)])


def check_tensors(shapes: dict[str, tuple[int, ...]], metadata: dict, *, where: str) -> None:
    """Raise InvalidArtifactError unless the tensors are exactly those ``metadata`` (checked by
    kvhub.artifact.metadata) implies, with the shapes of one of the structures in the module doc."""
    src, dst = metadata["source"], metadata["target"]
    map_kind = kind_of(metadata, where=where)
    settings = (metadata.get(map_kind.block) or {}) if map_kind.block else {}  # the block: checked by metadata
    expected: set[str] = set()
    for layer in metadata["layers"]:
        m, k = layer["target"], len(layer["sources"])
        d_in, d_out = k * src["num_kv_heads"] * src["head_dim"], dst["num_kv_heads"] * dst["head_dim"]
        for kind in ("k", "v"):
            prefix = map_prefix(kind, m)
            bias, mean = tensor_name(prefix, "bias"), tensor_name(prefix, "target_mean")
            expected |= _check_map(shapes, prefix, d_in, d_out, src, dst, where) | {bias}
            expected |= _check_kind_parts(shapes, prefix, map_kind.parts(settings, d_in, d_out), map_kind.name, where)
            if shapes.get(bias) != (d_out,):
                _fail(where, f"has {bias} of shape {shapes.get(bias)}, expected ({d_out},)")
            if mean in shapes:
                expected.add(mean)
                if shapes[mean] != (d_out,):
                    _fail(where, f"has {mean} of shape {shapes[mean]}, expected ({d_out},)")
    extra = sorted(set(shapes) - expected)
    if extra:
        _fail(
            where, f"holds tensors the format does not name ({', '.join(extra[:4])}{', ...' if len(extra) > 4 else ''})"
        )
    if is_compressed(shapes) and metadata["format_version"] < 2:
        _fail(where, "stores head-local or low-rank maps under format_version 1; they need format version 2")
    if metadata["format_version"] < map_kind.format_version:
        _fail(
            where,
            f"stores {map_kind.name} maps under format_version {metadata['format_version']}; they need "
            f"format version {map_kind.format_version}",
        )


def _check_kind_parts(shapes, prefix: str, parts: dict[str, tuple[int, ...]], kind: str, where: str) -> set[str]:
    """Check the tensors a map kind adds to map ``prefix`` ({part: shape}); returns their names."""
    names = set()
    for part, shape in parts.items():
        name = tensor_name(prefix, part)
        if shapes.get(name) != shape:
            found = f"lacks {name}" if name not in shapes else f"has {name} of shape {shapes[name]}"
            _fail(where, f"{found}; the {kind} map needs {shape} from mapper.json")
        names.add(name)
    return names


def _check_map(shapes, prefix: str, d_in: int, d_out: int, src: dict, dst: dict, where: str) -> set[str]:
    """Check one map's weight tensors; returns their names."""
    dense, low_rank = tensor_name(prefix, "weight"), (tensor_name(prefix, "weight_a"), tensor_name(prefix, "weight_b"))
    if dense in shapes and not any(n in shapes for n in low_rank):
        factors = [shapes[dense]]
    elif dense not in shapes and all(n in shapes for n in low_rank):
        factors = [shapes[n] for n in low_rank]
    else:
        _fail(where, f"needs either {dense} or both {low_rank[0]} and {low_rank[1]} for target layer map {prefix}")
    groups = factors[0][0] if len(factors[0]) == 3 else 1
    rank = factors[0][-1] if len(factors) == 2 else None
    heads_ok = groups >= 1 and src["num_kv_heads"] % groups == 0 and dst["num_kv_heads"] % groups == 0
    if len(factors[0]) == 3 and (groups < 2 or not heads_ok):
        _fail(
            where,
            f"splits {prefix} into {groups} head groups, which do not divide the KV heads "
            f"({src['num_kv_heads']} source, {dst['num_kv_heads']} target)",
        )
    lead = (groups,) if groups > 1 else ()
    rows, cols = d_in // groups, d_out // groups
    want = [lead + (rows, cols)] if rank is None else [lead + (rows, rank), lead + (rank, cols)]
    if factors != want or (rank is not None and rank < 1):
        names = [dense] if rank is None else list(low_rank)
        _fail(
            where,
            f"has {', '.join(names)} of shape {', '.join(map(str, factors))}, expected "
            f"{', '.join(map(str, want))} from the fingerprints' geometry",
        )
    return {dense} if rank is None else set(low_rank)


def _fail(where: str, problem: str):
    raise InvalidArtifactError(
        f"{where} {problem}; the artifact is corrupt or inconsistent, re-fetch it or re-fit the mapper", field="tensors"
    )
