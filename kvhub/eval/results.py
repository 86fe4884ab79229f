"""``kvhub eval``'s results in lm-evaluation-harness's shape, and where ``--output-path`` writes them.

The document (``--json`` on stdout, ``--output-path`` on disk)::

    {"ref": "SRC:DST:CALIB@v3",
     "results": {"hellaswag": {"acc_own": ..., "retention": ..., ...}, "hellaswag@exact_prefix=4": {...}},
     "config": {"model": "kvhub", "mapper": ref, "source": ..., "target": ..., "map_kind": ..., "tensors_sha256": ...,
                "dtype": ..., "device": ..., "limit": ..., "seed": ..., "variants": [...], "tasks": [...],
                "datasets": {"hellaswag": {"name": ..., "split": ..., "origin": ..., "sha256": ..., "n": ...}},
                "kvhub_version": ..., "date": ...}}

``results`` keeps kvhub's metric names (acc_own, acc_mapped, acc_source, retention, gap_closed, ...;
ppl_own, ppl_mapped, ...), one entry per task and recompute variant as before.  A data set's
``sha256`` hashes the items (or token windows) actually scored, so two result files with the same
hash scored the same inputs.

``--output-path`` follows lm-eval: a path ending in ``.json`` is the results file; anything else is a
directory, and the results go to ``DIR/<ref, sanitised>/results_<date>.json``.  ``--log-samples``
writes ``samples_<task>_<date>.jsonl`` beside it: one record per item and variant (item id, gold, each
condition's prediction and scores).
"""

from __future__ import annotations

import datetime as _datetime
import json
import math
import re
from dataclasses import asdict, is_dataclass
from pathlib import Path

from kvhub.artifact import json_sha256


def items_sha256(items) -> str:
    """sha256 of the scored items (dataclasses or plain data, in order), as canonical JSON (json_sha256)."""
    rows = [asdict(item) if is_dataclass(item) else item for item in items]
    return json_sha256(rows)


def now() -> str:
    """UTC time as lm-eval dates its files (``2026-01-31T12-00-00.000000``, safe in file names)."""
    return _datetime.datetime.now(_datetime.timezone.utc).strftime("%Y-%m-%dT%H-%M-%S.%f")


def document(ref: str, results: dict, config: dict) -> dict:
    """The results document (module docstring); ``config`` gets model, mapper, kvhub_version and date.
    Numbers that are not finite (gap closed when own == source) become null: the JSON stays strict."""
    from kvhub import __version__

    return finite(
        {
            "ref": ref,
            "results": results,
            "config": {
                "model": "kvhub",
                "mapper": ref,
                **config,
                "kvhub_version": __version__,
                "date": config.get("date") or now(),
            },
        }
    )


def finite(value):
    """``value`` with every NaN / infinite float (in dicts, lists, tuples) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


def output_files(output_path: str | Path, ref: str, date: str) -> tuple[Path, Path]:
    """(results file, samples directory) for ``--output-path`` (module docstring)."""
    path = Path(output_path).expanduser()
    if path.suffix == ".json":
        return path, path.parent
    # the ref comes from a store row: one plain folder name, never "." / ".." or a hidden name
    folder = path / (re.sub(r"[^A-Za-z0-9._@=-]+", "__", ref).strip("_.") or "mapper")
    return folder / f"results_{date}.json", folder


def write(
    doc: dict, samples: dict[str, list[dict]] | None, output_path: str | Path, *, folder_name: str | None = None
) -> list[Path]:
    """Write the document (and per-task samples, when given) under ``output_path``; returns the files.
    ``folder_name`` (default: the document's ref) names the folder under a directory ``output_path``."""
    results_file, folder = output_files(output_path, folder_name or doc["ref"], doc["config"]["date"])
    results_file.parent.mkdir(parents=True, exist_ok=True)
    written = [results_file]
    results_file.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    for task, records in (samples or {}).items():
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", task)
        path = folder / f"samples_{name}_{doc['config']['date']}.jsonl"
        with path.open("w") as handle:
            for record in records:
                handle.write(json.dumps(finite(record), default=str) + "\n")
        written.append(path)
    return written


# ---- per-item records (--log-samples) ----------------------------------------------------------------
def choice_record(task: str, variant: str, item, score) -> dict:
    """A multiple-choice item: gold, each condition's pick, correctness and per-choice log-likelihoods."""
    logprobs = score.logprobs or {}
    return {
        "task": task,
        "variant": variant,
        "doc_id": item.id,
        "gold": item.label,
        "gold_text": item.continuations[item.label] if 0 <= item.label < len(item.continuations) else None,
        "prediction": score.predictions(),
        "correct": {c: getattr(score, f"correct_{c}") for c in ("own", "mapped", "source")},
        "correct_norm": {c: getattr(score, f"correct_norm_{c}") for c in ("own", "mapped", "source")},
        "logprobs": logprobs,
        "agree_next": score.agree_next,
        "kl_next": score.kl_next,
        "attn_cosine": score.attn_cosine,
        "context": item.context,
        "choices": item.continuations,
    }


def recall_record(task: str, variant: str, item, score) -> dict:
    """A long-context item: the answer, each condition's teacher-forced prediction, exactness and scores."""
    return {
        "task": task,
        "variant": variant,
        "doc_id": item.id,
        "gold": item.answer,
        "prediction": score.predicted,
        "correct": score.exact,
        "token_acc": score.token_acc,
        "logprobs": score.logp,
        "recomputed": score.recomputed,
        "meta": item.meta,
    }


def window_record(task: str, variant: str, sample: dict) -> dict:
    """A perplexity window: token count, summed NLL of the scored half per condition, agreement, KL."""
    return {
        "task": task,
        "variant": variant,
        "doc_id": sample["index"],
        "tokens": sample["tokens"],
        "nll": {c: sample[f"nll_{c}"] for c in ("own", "mapped", "no_context")},
        "agreement": sample["agreement"],
        "kl": sample["kl"],
    }
