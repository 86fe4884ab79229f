"""Documents -> filtered, shuffled, tokenized, packed into fixed-length token sequences.

Contract (deterministic in the documents, the tokenizer and ``Sequences``):
1. Documents are sorted by id, filtered (length, exact dedup keeping the first id), then shuffled with
   ``random.Random(seed)``.
2. Documents are tokenized in that order without special tokens; each is cut to
   ``max_document_tokens`` and followed by the separator (the tokenizer's eos token, or the tokens of a
   blank line when it has none or the recipe asks for ``blank-line``).
3. The held-out stream takes whole documents until it holds ``M * body`` tokens; the rest of the
   document that crosses that mark is dropped; the train stream then takes the following documents
   until it holds ``N * body``.  Held-out and train sequences therefore never share a document.
4. Each stream is cut into windows of ``body = seq_len - len(prefix)`` tokens and every window starts
   with ``prefix``: the special tokens the tokenizer puts in front of a text by default (a BOS for
   Llama-style tokenizers, nothing for Qwen), so each sequence looks like an ordinary model input.
Conversations (documents with ``messages``) go through the tokenizer's chat template when the recipe
sets ``chat_template = true`` and the tokenizer has one; otherwise their plain ``Role: text`` form.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from kvhub.calib.readers import Document
from kvhub.progress import Progress, report
from kvhub.calib.recipe import Filters, Sequences, heldout_count

log = logging.getLogger(__name__)
# A set's note when its recipe renders conversations through the chat template and the tokenizer has none.
NO_CHAT_TEMPLATE = "the tokenizer has no chat template: conversations packed as plain text"
_BATCH_DOCUMENTS = 64
# Cutting text before tokenizing bounds the work on huge files; 16 chars per token is far above any
# real average, so the cut never reaches into the first max_document_tokens tokens.
_CHARS_PER_TOKEN_BOUND = 16


def filter_documents(documents: list[Document], filters: Filters) -> list[Document]:
    """Sorted by id; too short/long dropped; duplicates (whitespace-normalised) keep the first id."""
    kept, seen = [], set()
    for document in sorted(documents, key=lambda d: d.doc_id):
        size = len(document.text)
        if size < filters.min_chars or (filters.max_chars and size > filters.max_chars):
            continue
        if filters.dedup:
            key = hashlib.sha256(" ".join(document.text.split()).encode()).digest()
            if key in seen:
                continue
            seen.add(key)
        kept.append(document)
    return kept


def corpus_digest(documents: list[Document]) -> str:
    """sha256 over (id, text, messages) of the kept documents, in order."""
    digest = hashlib.sha256()
    for document in documents:
        digest.update(json.dumps([document.doc_id, document.text, document.messages]).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def default_prefix(tokenizer) -> list[int]:
    """Special tokens the tokenizer adds before a text by default ([] for Qwen, [bos] for Llama)."""
    probe = "Hello"
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    full = tokenizer(probe)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return list(full[:start])
    return []


def separator_ids(tokenizer, separator: str) -> list[int]:
    """Tokens between documents: [eos] when asked and available, else a blank line."""
    if separator == "eos" and tokenizer.eos_token_id is not None:
        return [int(tokenizer.eos_token_id)]
    return list(tokenizer("\n\n", add_special_tokens=False)["input_ids"])


@dataclass
class Packed:
    """Packed sequences, int64: train (N, T), heldout (M, T); document counts per side."""

    train: torch.Tensor
    heldout: torch.Tensor
    train_documents: int
    heldout_documents: int
    notes: list[str] = field(default_factory=list)


class TokenStream:
    """Tokenizes documents lazily, in order, remembering what it did (for a second packing pass)."""

    def __init__(self, documents: list[Document], tokenizer, sequences: Sequences):
        self.documents = documents
        self.tokenizer = tokenizer
        self.sequences = sequences
        self.separator = separator_ids(tokenizer, sequences.separator)
        self.tokens: list[list[int]] = []
        self.notes: list[str] = []
        self._use_template = sequences.chat_template and bool(getattr(tokenizer, "chat_template", None))
        if sequences.chat_template and not self._use_template and any(d.messages for d in documents):
            self.notes.append(NO_CHAT_TEMPLATE)

    def _text(self, document: Document) -> str:
        if not (self._use_template and document.messages):
            text = document.text
        else:
            messages = [{"role": role, "content": content} for role, content in document.messages]
            try:
                text = self.tokenizer.apply_chat_template(messages, tokenize=False)
            except Exception as exc:  # noqa: BLE001 - jinja templates raise their own errors for role orders they reject
                log.warning("chat template failed on %s (%s); using plain text", document.doc_id, exc)
                text = document.text
        limit = self.sequences.max_document_tokens
        return text[: limit * _CHARS_PER_TOKEN_BOUND] if limit else text

    def _tokenize(self, documents: list[Document]) -> None:
        encoded = self.tokenizer([self._text(d) for d in documents], add_special_tokens=False)["input_ids"]
        limit = self.sequences.max_document_tokens
        for ids in encoded:
            self.tokens.append(list(ids[:limit] if limit else ids) + self.separator)

    def __iter__(self) -> Iterator[list[int]]:
        for index in range(len(self.documents)):
            if index >= len(self.tokens):
                self._tokenize(self.documents[index : index + _BATCH_DOCUMENTS])
            yield self.tokens[index]


def _fill(stream: Iterator[list[int]], needed: int) -> tuple[list[int], int]:
    buffer, documents = [], 0
    while len(buffer) < needed:
        tokens = next(stream, None)
        if tokens is None:
            break
        buffer.extend(tokens)
        documents += 1
    return buffer[:needed], documents


def _windows(buffer: list[int], prefix: list[int], body: int) -> torch.Tensor:
    rows = [prefix + buffer[i * body : (i + 1) * body] for i in range(len(buffer) // body)]
    return torch.tensor(rows, dtype=torch.long).reshape(len(rows), len(prefix) + body)  # (rows, T)


def pack(
    tokens, *, prefix: list[int], seq_len: int, samples: int, heldout: int, progress: Progress | None = None
) -> Packed | None:
    """Pack a token stream into ``heldout`` then ``samples`` sequences; None when it runs out."""
    body = seq_len - len(prefix)
    stream = iter(tokens)
    held_buffer, held_docs = _fill(stream, heldout * body)
    report(progress, "tokenize", len(held_buffer), (heldout + samples) * body)
    train_buffer, train_docs = _fill(stream, samples * body)
    report(progress, "tokenize", len(held_buffer) + len(train_buffer), (heldout + samples) * body)
    if len(held_buffer) < heldout * body or len(train_buffer) < samples * body:
        return None
    return Packed(_windows(train_buffer, prefix, body), _windows(held_buffer, prefix, body), train_docs, held_docs)


def max_samples(lengths: list[int], *, body: int, samples: int, heldout_fraction: float) -> int:
    """Largest N <= samples that packs (with M = heldout_count(N)) from documents of these lengths; 0 if none."""

    def fits(n: int) -> bool:
        need_held, need_train, index = heldout_count(n, heldout_fraction) * body, n * body, 0
        for need in (need_held, need_train):
            total = 0
            while total < need and index < len(lengths):
                total += lengths[index]
                index += 1
            if total < need:
                return False
        return True

    low, high = 0, samples
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def shuffle_documents(documents: list[Document], seed: int) -> list[Document]:
    order = list(documents)
    random.Random(seed).shuffle(order)
    return order
