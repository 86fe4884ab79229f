"""resolve_calibration(): a spec -> a CalibrationSet of token sequences, cached by content hash.

content_hash = sha256 of the sorted JSON of
    {packing: PACKING_VERSION, corpus: sha256 of the kept documents (ids, texts),
     sequences: seq_len, samples, heldout_fraction, seed, max_document_tokens, separator, chat_template,
     tokenizer: sha256 of the tokenizer's full definition (tokenizer.json), its default prefix and eos
                token, and its chat template when the recipe renders through it}.
It is the calibration set's identity in mapper metadata: the same name over a changed corpus, tokenizer
or size is a different hash; a renamed or re-described recipe over the same text is the same hash.
``stride`` is carried for capture and is not part of the hash (the token sequences do not depend on it).
Built sets are cached as ``<cache>/calibration/<name>/<content_hash>.safetensors``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvhub.artifact import json_sha256
from kvhub.artifact.files import atomic_write_if_room
from kvhub.errors import ConfigError, CorpusTooSmallError
from kvhub.progress import Progress
from kvhub.calib.corpus import cache_root, locate, read_source
from kvhub.calib.packing import (
    NO_CHAT_TEMPLATE,
    TokenStream,
    corpus_digest,
    default_prefix,
    filter_documents,
    max_samples,
    pack,
    shuffle_documents,
)
from kvhub.calib.recipe import Recipe, heldout_count, recipe_from_spec

log = logging.getLogger(__name__)
PACKING_VERSION = 1
_HASHED_SEQUENCE_FIELDS = (
    "seq_len",
    "samples",
    "heldout_fraction",
    "seed",
    "max_document_tokens",
    "separator",
    "chat_template",
)


@dataclass
class CalibrationSet:
    """Token sequences for a fit.  train (N, T) and heldout (M, T) are int64 on CPU, owned by the caller.

    ``requested_samples`` is set only when the corpus was too small and fewer train sequences were
    used (``allow_fewer=True``); ``notes`` says so in words.
    """

    name: str
    version: int
    content_hash: str
    train: torch.Tensor
    heldout: torch.Tensor
    recipe: dict
    tokenizer_id: str = ""
    tokenizer_hash: str = ""
    corpus_hash: str = ""
    sources: list[str] = field(default_factory=list)
    train_documents: int = 0
    heldout_documents: int = 0
    requested_samples: int | None = None
    notes: list[str] = field(default_factory=list)
    cache_path: str | None = None

    @property
    def seq_len(self) -> int:
        return int(self.train.shape[1])

    @property
    def stride(self) -> int:
        """Capture keeps every stride-th token of each sequence."""
        return int(self.recipe["sequences"]["stride"])

    def to_metadata(self) -> dict:
        """JSON-ready summary for mapper.json["calibration"]."""
        metadata = {
            "name": self.name,
            "version": self.version,
            "content_hash": self.content_hash,
            "sequences": int(self.train.shape[0]),
            "heldout_sequences": int(self.heldout.shape[0]),
            "seq_len": self.seq_len,
            "tokens": int(self.train.numel()),
            "heldout_tokens": int(self.heldout.numel()),
            "stride": self.stride,
            "seed": int(self.recipe["sequences"]["seed"]),
            "documents": {"train": self.train_documents, "heldout": self.heldout_documents},
            "licence": self.recipe["licence"],
            "sources": list(self.sources),
            "tokenizer_id": self.tokenizer_id,
            "tokenizer_hash": self.tokenizer_hash,
            "corpus_hash": self.corpus_hash,
        }
        if self.requested_samples is not None:
            metadata["requested_sequences"] = self.requested_samples
        if self.notes:
            metadata["notes"] = list(self.notes)
        return metadata


def tokenizer_digest(tokenizer, *, with_chat_template: bool = False) -> str:
    """sha256 of everything about the tokenizer that changes the packed ids.

    The chat template counts only for recipes that render through it: Qwen2.5-Coder 0.5B and 1.5B
    differ in nothing but their templates' tool-call text, and pack plain text identically.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    parts = {"prefix": default_prefix(tokenizer), "eos": tokenizer.eos_token_id}
    if with_chat_template:
        parts["chat_template"] = getattr(tokenizer, "chat_template", None)
    if backend is not None:
        parts["definition"] = hashlib.sha256(backend.to_str().encode()).hexdigest()
    else:
        from kvhub.core.fingerprint import tokenizer_hash

        parts["vocab"] = tokenizer_hash(tokenizer)
    return json_sha256(parts)


def content_hash(recipe: Recipe, *, corpus: str, tokenizer: str) -> str:
    sequences = {name: getattr(recipe.sequences, name) for name in _HASHED_SEQUENCE_FIELDS}
    return json_sha256({"packing": PACKING_VERSION, "corpus": corpus, "sequences": sequences, "tokenizer": tokenizer})


def set_path(name: str, digest: str) -> Path:
    return cache_root() / "calibration" / name / f"{digest}.safetensors"


def _save(calibration_set: CalibrationSet, path: Path) -> bool:
    from safetensors.torch import save

    fields = {
        f.name: getattr(calibration_set, f.name)
        for f in dataclasses.fields(calibration_set)
        if f.name not in ("train", "heldout", "cache_path")
    }
    tensors = {"train": calibration_set.train.to(torch.int32), "heldout": calibration_set.heldout.to(torch.int32)}
    data = save(tensors, metadata={"kvhub_calibration": json.dumps(fields, sort_keys=True)})
    return atomic_write_if_room(path, data, then="the calibration set is used uncached (built again next time)")


def _load(path: Path) -> CalibrationSet | None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            fields = json.loads(handle.metadata()["kvhub_calibration"])
            train, heldout = handle.get_tensor("train").long(), handle.get_tensor("heldout").long()
    except Exception as exc:  # noqa: BLE001 - a corrupt cache entry is rebuilt, never trusted
        log.warning("ignoring unreadable calibration cache %s (%s); rebuilding", path, exc)
        return None
    known = {f.name for f in dataclasses.fields(CalibrationSet)}
    return CalibrationSet(
        train=train, heldout=heldout, cache_path=str(path), **{k: v for k, v in fields.items() if k in known}
    )


_SPLIT_TEXT = (
    "split the text into more documents: a directory of files, a .jsonl file (one document per "
    "line), or a .txt file with blank lines between paragraphs (or one document per line)"
)


def _too_small(recipe: Recipe, available: int, lengths: list[int], *, body: int = 0) -> CorpusTooSmallError:
    """The error for a corpus that packs only ``available`` train sequences; ``lengths``: its documents'
    token counts (separators included), ``body``: the tokens of one sequence after the prefix.  It names
    the real cause: too little text, or text in too few documents to split (the held-out part takes whole
    documents, and the rest of the one crossing its end is dropped)."""
    sequences = recipe.sequences
    wanted = f"{sequences.samples} train + {sequences.heldout_samples} held-out sequences of {sequences.seq_len} tokens"
    held = f"its {len(lengths)} document{'s' if len(lengths) != 1 else ''} ({sum(lengths):,} tokens)"
    if not lengths:
        cause, hint = "it has no documents (every file is empty, binary or filtered out)", "pass a corpus with text"
    elif available > 0:
        cause = f"{held} yield at most {available} train sequences (plus their held-out share)"
        hint = f"pass --samples {available} (or samples={available}), a shorter --seq-len, or more text"
    elif sum(lengths) < 2 * body:
        cause = f"{held} are fewer than one train and one held-out sequence need ({2 * body:,} tokens)"
        hint = "use a shorter --seq-len or more text"
    else:
        cause = (
            f"{held} cannot be split into disjoint train and held-out sequences: the held-out part takes "
            "whole documents, and the rest of the one crossing its end is dropped"
        )
        hint = _SPLIT_TEXT
    return CorpusTooSmallError(
        f"calibration set {recipe.name!r} has too little text for {wanted}: {cause}; {hint}",
        requested=sequences.samples,
        available=available,
    )


def _pack(recipe: Recipe, documents, tokenizer, *, allow_fewer: bool, progress: Progress | None):
    sequences = recipe.sequences
    stream = TokenStream(shuffle_documents(documents, sequences.seed), tokenizer, sequences)
    prefix = default_prefix(tokenizer)
    if sequences.seq_len <= len(prefix):
        raise ConfigError(
            f"seq_len {sequences.seq_len} leaves no room after the tokenizer's {len(prefix)} "
            "prefix tokens; use a longer --seq-len"
        )
    packed = pack(
        stream,
        prefix=prefix,
        seq_len=sequences.seq_len,
        samples=sequences.samples,
        heldout=sequences.heldout_samples,
        progress=progress,
    )
    if packed is not None:
        packed.notes.extend(stream.notes)
        return recipe, packed
    body = sequences.seq_len - len(prefix)
    lengths = [len(tokens) for tokens in stream]
    available = max_samples(lengths, body=body, samples=sequences.samples, heldout_fraction=sequences.heldout_fraction)
    if not allow_fewer or available == 0:
        raise _too_small(recipe, available, lengths, body=body)
    smaller = recipe.with_sequences(samples=available)
    packed = pack(
        stream,
        prefix=prefix,
        seq_len=sequences.seq_len,
        samples=available,
        heldout=heldout_count(available, sequences.heldout_fraction),
    )
    note = (
        f"corpus too small: using {available} train + {packed.heldout.shape[0]} held-out sequences "
        f"instead of {sequences.samples} + {sequences.heldout_samples}"
    )
    log.info("%s: %s", recipe.name, note)  # the notes carry it; kvhub calib build prints them
    packed.notes.extend([*stream.notes, note])
    return smaller, packed


def read_documents(recipe: Recipe, *, progress: Progress | None = None):
    """(kept documents, one summary line per source) after fetching and filtering."""
    documents, summaries = [], []
    for number, source in enumerate(recipe.sources, start=1):
        label = f"source {number}/{len(recipe.sources)} ({source.kind})"
        found, summary = read_source(source, recipe, progress=progress, label=label)
        documents.extend(found)
        summaries.append(summary)
    return filter_documents(documents, recipe.filters), summaries


def resolve_calibration(
    spec: str,
    *,
    tokenizer,
    tokenizer_id: str,
    samples: int | None = None,
    seq_len: int | None = None,
    heldout_fraction: float | None = None,
    seed: int | None = None,
    progress: Progress | None = None,
    allow_fewer: bool = False,
) -> CalibrationSet:
    """Fetch, tokenize and pack a calibration set (or load it from the cache).

    spec: a built-in name (``kvhub calib list``), a recipe ``.toml``, a ``.txt``/``.jsonl`` file, a
    directory of text files, or ``hf:<dataset>[:<config>]:<split>:<field>``.
    samples: train sequences N; held-out M = max(1, round(N f / (1 - f))) with f = heldout_fraction.
    Overrides left as None keep the recipe's values.  progress(description, completed, total | None)
    is called as work advances; the library never prints.
    A corpus too small for N + M sequences raises CorpusTooSmallError naming the count that fits;
    with ``allow_fewer=True`` that count is used instead, and ``requested_samples``/``notes`` say so.
    """
    recipe = recipe_from_spec(spec).with_sequences(
        samples=samples, seq_len=seq_len, heldout_fraction=heldout_fraction, seed=seed
    )
    documents, summaries = read_documents(recipe, progress=progress)
    if not documents:
        raise _too_small(recipe, 0, [])
    corpus = corpus_digest(documents)
    tokenizer_hash = tokenizer_digest(tokenizer, with_chat_template=recipe.sequences.chat_template)
    digest = content_hash(recipe, corpus=corpus, tokenizer=tokenizer_hash)
    cached = _load(set_path(recipe.name, digest)) if set_path(recipe.name, digest).exists() else None
    if cached is not None:
        _say_plain_chats(cached, tokenizer_id)
        return dataclasses.replace(cached, tokenizer_id=tokenizer_id)
    built_recipe, packed = _pack(recipe, documents, tokenizer, allow_fewer=allow_fewer, progress=progress)
    built_digest = content_hash(built_recipe, corpus=corpus, tokenizer=tokenizer_hash)
    calibration_set = CalibrationSet(
        name=recipe.name,
        version=recipe.version,
        content_hash=built_digest,
        train=packed.train,
        heldout=packed.heldout,
        recipe=built_recipe.to_dict(),
        tokenizer_id=tokenizer_id,
        tokenizer_hash=tokenizer_hash,
        corpus_hash=corpus,
        sources=summaries,
        train_documents=packed.train_documents,
        heldout_documents=packed.heldout_documents,
        requested_samples=recipe.sequences.samples if built_recipe is not recipe else None,
        notes=packed.notes,
    )
    path = set_path(recipe.name, built_digest)
    if _save(calibration_set, path):
        calibration_set.cache_path = str(path)
    _say_plain_chats(calibration_set, tokenizer_id)
    return calibration_set


def _say_plain_chats(calibration_set: CalibrationSet, tokenizer_id: str) -> None:
    """A warning each time a set whose recipe renders chats through the chat template is used with a tokenizer
    that has none (the default ``mixed`` on a base model): its conversations are plain ``Role: text``
    lines, not the model's chat format, which only the set's notes said before."""
    if NO_CHAT_TEMPLATE in calibration_set.notes:
        log.warning(
            "the tokenizer of %s has no chat template: the conversations of calibration set %s are packed as "
            "plain 'Role: text' lines, not in the model's chat format (a model with a chat "
            "template, or a set without conversations, avoids this)",
            tokenizer_id,
            calibration_set.name,
        )


def fetch_corpus(spec: str, *, progress: Progress | None = None) -> list[str]:
    """Fetch every fetchable source of a recipe into the cache; one 'where' line per source."""
    recipe = recipe_from_spec(spec)
    return [
        f"{source.summary()}: {locate(source, recipe, fetch=True, progress=progress)[2]}"
        if source.kind != "hf"
        else f"{source.summary()}: loaded at build time"
        for source in recipe.sources
    ]


def source_status(recipe: Recipe) -> list[dict]:
    """Per source: summary, licence, required, and where it is now (nothing is fetched)."""
    status = []
    for source in recipe.sources:
        if source.kind == "hf":
            where = "loaded from the Hugging Face Hub at build time"
        else:
            where = locate(source, recipe, fetch=False)[2]
        status.append(
            {"source": source.summary(), "licence": source.licence, "required": source.required, "where": where}
        )
    return status
