"""mapper.json: format versions, the type and range of every field kvhub reads, and their consistency.

:func:`check_metadata` is the one validator of mapper.json; :mod:`kvhub.artifact.tensors` checks the
tensor file against it.  Fields kvhub does not read (``probe_r2``, ``fit``, ``notes``, ``created``,
...) are kept as they are; the ones it reads must be right, or the artifact is refused with
:class:`InvalidArtifactError` naming the field.  Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Literal, NoReturn, overload

from kvhub import __version__
from kvhub.errors import FormatVersionError, InvalidArtifactError
from kvhub.artifact.kinds import kind_of

FORMAT_VERSION = 4  # the newest mapper artifact format this kvhub reads and writes
# 1: dense maps only; 2: head-local or low-rank maps present; 3: target_mean tensors present (any structure);
# 4: a map kind beyond ridge (kvhub.artifact.kinds: mlp)
SUPPORTED_FORMAT_VERSIONS = (1, 2, 3, 4)
TENSORS_FILE = "mapper.safetensors"
METADATA_FILE = "mapper.json"
DTYPES = ("float32", "bfloat16", "float16")  # fingerprint ``dtype``: the default dtype of transfer()

_SHA256 = re.compile(r"[0-9a-f]{64}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # newline, tab, escape, ...: they would reach cards, tables and refs
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_FINGERPRINT_INTS = ("num_layers", "num_kv_heads", "head_dim")
_LAMBDAS = ("lambda_k", "lambda_v")
# Per-layer R^2 (held-out, training, and kind mlp's ridge baseline): finite and at most 1 (1 - SSE/SST with
# SSE >= 0; R2_ROUNDING allows a noiseless fit's rounding).  De-shrinking divides by sqrt(R^2): an Inf or
# 7.5 would silently turn the map into the calibration mean, a NaN break every transfer.
R2_FIELDS = ("r2_k", "r2_v", "train_r2_k", "train_r2_v", "ridge_r2_k", "ridge_r2_v")
R2_ROUNDING = 1e-6
_LAYER_COUNTS = ("mlp_epochs_k", "mlp_epochs_v", "mlp_best_epoch_k", "mlp_best_epoch_v")  # kind mlp


def canonical_json(obj) -> bytes:
    """``obj`` as sorted-key, ASCII JSON (anything else as its ``str``): the bytes every kvhub content hash takes."""
    return json.dumps(obj, sort_keys=True, default=str).encode()


def json_sha256(obj) -> str:
    """sha256 of :func:`canonical_json`: the one canonical-JSON hash (a fingerprint's ``config_hash``, the
    evaluation cache's keys, the items and texts a result was scored on, a fit's checkpoint key)."""
    return hashlib.sha256(canonical_json(obj)).hexdigest()


def parse_json(text: str | bytes):
    """``json.loads``, where a document nested deeper than the parser follows (RecursionError) or too large for
    memory is a ValueError like any other malformed JSON: what every reader of a file kvhub did not write
    (mapper.json, a safetensors or checkpoint header) catches."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested deeper than the JSON parser follows") from None
    except MemoryError:
        raise ValueError("too large to parse") from None


def is_plain_file_name(name) -> bool:
    """A file name with no directory part, not hidden, of safe characters (``mapper.safetensors``)."""
    return isinstance(name, str) and bool(_FILE_NAME.fullmatch(name)) and name not in (".", "..")


class _Fields:
    """Typed access to one JSON object; every failure names the field's path (``layers[2].sources``)."""

    def __init__(self, obj, path: str, where: str):
        self.path, self.where = path, where
        if not isinstance(obj, dict):
            self.fail(path, f"must be a JSON object, not {_json_type(obj)}")
        self.obj = obj

    def fail(self, path: str, problem: str) -> NoReturn:
        what = f"field `{path}`" if path else "(the whole document)"
        raise InvalidArtifactError(
            f"{self.where}: {METADATA_FILE} {what} {problem}; the artifact is corrupt or was edited, "
            "re-fetch it or re-fit the mapper",
            field=path,
        )

    def _name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def get(self, key: str, kinds: tuple, *, required: bool = True, what: str = ""):
        """The value at ``key`` if it has one of ``kinds`` (bool is never an int); None when optional and absent."""
        if key not in self.obj or (self.obj[key] is None and type(None) in kinds):
            if required and key not in self.obj:
                self.fail(self._name(key), "is missing")
            return None
        value = self.obj[key]
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            self.fail(self._name(key), f"must be {what or _names(kinds)}, not {_json_type(value)} {_show(value)}")
        return value

    @overload
    def integer(
        self, key: str, *, low: int = ..., high: int = ..., required: Literal[True] = ..., null: Literal[False] = ...
    ) -> int: ...
    @overload
    def integer(
        self, key: str, *, low: int = ..., high: int = ..., required: bool = ..., null: bool = ...
    ) -> int | None: ...
    def integer(
        self, key: str, *, low: int = 0, high: int = 1 << 31, required: bool = True, null: bool = False
    ) -> int | None:
        value = self.get(key, (int, type(None)) if null else (int,), required=required, what="an integer")
        if value is not None and not low <= value < high:
            self.fail(self._name(key), f"must be an integer in {low}..{high - 1}, not {_show(value)}")
        return value

    def number(
        self, key: str, *, finite: bool = True, low: float | None = None, high: float | None = None
    ) -> float | None:
        value = self.get(key, (int, float, type(None)), required=False, what="a number or null")
        if value is not None and finite and not math.isfinite(value):
            self.fail(self._name(key), f"must be a finite number, not {_show(value)}")
        if value is not None and low is not None and value < low:
            self.fail(self._name(key), f"must be >= {low}, not {_show(value)}")
        if value is not None and high is not None and value > high:
            self.fail(self._name(key), f"must be at most {high:g}, not {_show(value)}")
        return value

    def text(
        self,
        key: str,
        *,
        required: bool = True,
        null: bool = False,
        pattern: re.Pattern | None = None,
        max_length: int = 4096,
    ) -> str | None:
        value = self.get(key, (str, type(None)) if null else (str,), required=required, what="a string")
        if value is None:
            return None
        if not value.strip() or len(value) > max_length:
            self.fail(self._name(key), f"must be a non-empty string of at most {max_length} characters")
        self.no_control(key, value)
        if pattern is not None and not pattern.fullmatch(value):
            self.fail(self._name(key), f"has the wrong form: {_show(value)}")
        return value

    def no_control(self, key: str, value: str, *, what: str = "") -> None:
        """Refuse a control character (below 0x20, or 0x7f) in the text ``value`` of field ``key``."""
        found = _CONTROL.search(value)
        if found:
            self.fail(
                self._name(key),
                f"{what or 'contains'} the control character {found.group()!r} at position "
                f"{found.start()}; names and ids are one line of printable text",
            )

    @overload
    def child(self, key: str, *, required: Literal[True] = ...) -> "_Fields": ...
    @overload
    def child(self, key: str, *, required: bool) -> "_Fields | None": ...
    def child(self, key: str, *, required: bool = True) -> "_Fields | None":
        if key not in self.obj and not required:
            return None
        return _Fields(self.get(key, (dict,), what="a JSON object"), self._name(key), self.where)


def check_format_version(metadata, *, where: str) -> int:
    """``format_version`` as an int this kvhub reads; FormatVersionError (upgrade kvhub) for a newer one."""
    fields = _Fields(metadata, "", where)
    version = fields.integer("format_version", low=1, high=1 << 63)
    if version > FORMAT_VERSION:
        kind = metadata.get("kind")
        named = (
            f" (a map of kind {kind!r})"
            if isinstance(kind, str) and len(kind) <= 64 and not _CONTROL.search(kind)
            else ""
        )
        raise FormatVersionError(
            f"{where} has artifact format version {version}{named}, this kvhub ({__version__}) reads up to "
            f"{FORMAT_VERSION}; upgrade with `pip install -U kvhub`"
        )
    return version


def check_metadata(metadata, *, where: str) -> dict:
    """Raise unless ``metadata`` (parsed mapper.json) satisfies the format (docs/artifact-format.md).

    Checks the format version, both fingerprints (types, geometry consistent with the recorded config,
    ``config_hash`` the hash of ``config``), the calibration set's name, ``k``/``lambda``/``structure``,
    ``layers`` (a permutation-free list whose targets cover every target layer exactly once, sources
    ascending within the source's layers) and ``tensors`` (a plain file name and a sha256).
    Returns ``metadata``.
    """
    check_format_version(metadata, where=where)
    fields = _Fields(metadata, "", where)
    fields.text("kvhub_version", required=False, max_length=64)
    _check_kind(fields, where)
    source = _check_fingerprint(fields, "source")
    target = _check_fingerprint(fields, "target")
    calibration = fields.child("calibration")
    calibration.text("name", required=False, max_length=256)  # the set's own name
    calibration.text("series", required=False, max_length=256)  # the store's series key (calibration_series)
    version = calibration.get("version", (str, int, float, type(None)), required=False, what="a string or a number")
    if isinstance(version, str):
        calibration.no_control("version", version)
    calibration.text("content_hash", required=False, null=True, max_length=128)
    calibration.integer("tokens", required=False, null=True, high=1 << 62)
    _check_choice_or_number(fields, "k", integer=True)
    _check_choice_or_number(fields, "lambda", integer=False)
    structure = fields.child("structure", required=False)
    if structure is not None:
        structure.integer("head_groups", low=1, required=False)
        structure.integer("rank", low=1, required=False, null=True)
    metrics = fields.get("metrics", (dict,), required=False, what="a JSON object") or {}
    for name in metrics:  # their names become store rows and table columns
        fields.no_control("metrics", name, what=f"has a metric name {_show(name)} with")
    _check_layers(fields, source, target)
    tensors = fields.child("tensors")
    name = tensors.text("file", max_length=128)
    if not is_plain_file_name(name):
        tensors.fail("tensors.file", f"must be a plain file name inside the artifact directory, not {_show(name)}")
    tensors.text("sha256", pattern=_SHA256, max_length=64)
    tensors.integer("bytes", required=False, high=1 << 62)
    return metadata


def _check_kind(fields: _Fields, where: str) -> None:
    """``kind`` a map kind this kvhub knows (FormatVersionError naming it otherwise), its settings block right."""
    fields.get("kind", (str, type(None)), required=False, what="a string")
    kind = kind_of(fields.obj, where=where)
    if kind.block is not None:
        settings = fields.child(kind.block)
        problem = kind.check(settings.obj, _target_layers(fields))
        if problem:
            fields.fail(f"{kind.block}.{problem[0]}", problem[1])


def _target_layers(fields: _Fields) -> int:
    """The target's layer count (``target.num_layers`` checked, so the kind's check can count per layer)."""
    return fields.child("target").integer("num_layers", low=1, high=1 << 20)


def _check_fingerprint(fields: _Fields, role: str) -> dict:
    fp = fields.child(role)
    for key in ("model_id", "model_type", "family"):
        fp.text(key, max_length=1024 if key == "model_id" else 64)
    for key in ("revision", "tokenizer_hash"):
        fp.text(key, required=False, null=True, max_length=256)
    fp.text("config_hash", pattern=_SHA256, max_length=64)
    dtype = fp.text("dtype", required=False, null=True, max_length=32)
    if dtype is not None and dtype.replace("torch.", "") not in DTYPES:
        fp.fail(f"{role}.dtype", f"must be one of {', '.join(DTYPES)}, not {_show(dtype)}")
    geometry = {key: fp.integer(key, low=1, high=1 << 20) for key in _FINGERPRINT_INTS}
    fp.get("rope", (dict,), required=False, what="a JSON object")
    layer_types = fp.get("layer_types", (list,), required=False, what="a list")
    if layer_types and not all(isinstance(t, str) and not _CONTROL.search(t) for t in layer_types):
        fp.fail(f"{role}.layer_types", "must be a list of strings without control characters")
    config = fp.get("config", (dict,), what="a JSON object")
    if json_sha256(config) != fp.obj["config_hash"]:
        fp.fail(f"{role}.config", "does not hash to its config_hash (the config was edited)")
    recorded = config_geometry(config)
    for key, value in zip(_FINGERPRINT_INTS, recorded):
        if value is not None and value != geometry[key]:
            fp.fail(f"{role}.{key}", f"is {geometry[key]}, but the recorded config says {value}")
    return fp.obj


def config_geometry(config: dict) -> tuple[int | None, int | None, int | None]:
    """(layers, KV heads, head dim) a reduced config implies, None where it does not say (as
    kvhub.core.fingerprint.kv_geometry computes them from a transformers config)."""
    inner = config.get("text_config")
    config = inner if isinstance(inner, dict) else config
    heads = _int_or_none(config.get("num_attention_heads"))
    kv_heads = _int_or_none(config.get("num_key_value_heads")) or heads
    head_dim = _int_or_none(config.get("head_dim"))
    hidden = _int_or_none(config.get("hidden_size"))
    if head_dim is None and hidden and heads:
        head_dim = hidden // heads
    return _int_or_none(config.get("num_hidden_layers")), kv_heads, head_dim


def _int_or_none(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def describe_structure(structure: dict | None) -> str:
    """'dense', 'head-local (2 groups)', 'rank 64', or both, from mapper.json's ``structure``: the one wording
    of a map's structure (fit summary, model card, report and plots)."""
    structure = structure or {}
    groups, rank = structure.get("head_groups") or 1, structure.get("rank")
    parts = [f"head-local ({groups} groups)"] if groups > 1 else []
    if rank is not None:
        parts.append(f"rank {rank}")
    return ", ".join(parts) or "dense"


def calibration_series(calibration: dict | None) -> str | None:
    """The calibration name a mapper's versions are filed under, the CALIB of ``SRC:DST:CALIB``: mapper.json's
    ``calibration.series`` (``kvhub fit --name``, else the set's own name), or ``calibration.name`` in files
    written before that field (their ``name`` held the series, the set's name being lost under ``--name``)."""
    calibration = calibration if isinstance(calibration, dict) else {}
    return calibration.get("series") or calibration.get("name")


def shown(choice):
    """``k`` or ``lambda`` as a table or JSON shows it: "auto" for null (chosen per target layer: each layer's
    own is in ``layers``; older files hold the text "auto" itself), else the value."""
    return "auto" if choice is None or choice == "auto" else choice


def _check_choice_or_number(fields: _Fields, key: str, *, integer: bool) -> None:
    value = fields.obj.get(key)
    if value is None or value == "auto":  # "auto": what older files hold for null
        return
    ok = (
        isinstance(value, int) and value >= 1
        if integer
        else isinstance(value, (int, float)) and math.isfinite(value) and value >= 0
    )
    if isinstance(value, bool) or not ok:
        kind = "an integer >= 1" if integer else "a finite number >= 0"
        fields.fail(key, f'must be {kind}, "auto" or null, not {_show(value)}')


def _check_layers(fields: _Fields, source: dict, target: dict) -> None:
    layers = fields.get("layers", (list,), what="a list")
    if len(layers) != target["num_layers"]:
        fields.fail(
            "layers",
            f"has {len(layers)} entries; the target has {target['num_layers']} layers, each mapped exactly once",
        )
    seen: dict[int, int] = {}
    for index, layer in enumerate(layers):
        entry = _Fields(layer, f"layers[{index}]", fields.where)
        m = entry.integer("target", high=target["num_layers"])
        if m in seen:
            entry.fail(f"layers[{index}].target", f"repeats target layer {m} (also layers[{seen[m]}])")
        seen[m] = index
        sources = entry.get("sources", (list,), what="a list")
        if not sources or not all(isinstance(s, int) and not isinstance(s, bool) for s in sources):
            entry.fail(f"layers[{index}].sources", f"must be a non-empty list of layer indices, not {_show(sources)}")
        if not all(0 <= s < source["num_layers"] for s in sources) or sorted(set(sources)) != sources:
            entry.fail(
                f"layers[{index}].sources",
                f"must be ascending distinct source layers in 0..{source['num_layers'] - 1}, not {_show(sources)}",
            )
        for key in _LAMBDAS:
            entry.number(key, low=0)
        for key in R2_FIELDS:  # an R^2 (finite, at most 1) or null
            entry.number(key, high=1 + R2_ROUNDING)
        for key in _LAYER_COUNTS:
            entry.integer(key, required=False)
        entry.integer("k", low=1, required=False, null=True)


def _json_type(value) -> str:
    names = {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        type(None): "null",
    }
    return names.get(type(value), type(value).__name__)


def _names(kinds: tuple) -> str:
    return " or ".join(_json_type(kind()) if kind is not type(None) else "null" for kind in kinds)


def _show(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."
