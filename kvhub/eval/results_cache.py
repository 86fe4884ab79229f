"""Per-item evaluation results, cached so an interrupted evaluation resumes and a new variant reuses the rest.

One JSONL file per (mapper tensors, task, seed, variant, dtype, device, deshrink) under
``<cache>/eval-cache/<tensors sha256[:24]>/``; each line is ``{"id": item id, "score": {...}}``,
appended and flushed as soon as the item is scored (a line cut by a kill is ignored on reading); the
id carries a hash of the item's content (:func:`item_key`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path

from kvhub.artifact import json_sha256
from kvhub.progress import Progress, report


def results_file(
    tensors_sha256: str, task: str, *, seed: int, variant: str, dtype: str, device: str, deshrink: str = "off"
) -> Path:
    """Where the per-item results of one (mapper, task, seed, variant, dtype, device, deshrink) live (files
    of maps as fitted keep the key they had before deshrink existed)."""
    from kvhub.env import cache_root

    fields = [variant, str(dtype), str(device)] + ([f"deshrink={deshrink}"] if deshrink != "off" else [])
    key = json_sha256(fields)[:12]
    stem = re.sub(r"[^A-Za-z0-9._@=-]+", "_", task)  # "ppl:lambada/256" is one file name
    return cache_root() / "eval-cache" / tensors_sha256[:24] / f"{stem}-seed{seed}-{key}.jsonl"


def variant_key(spec) -> str:
    """What a recompute variant's cached results are keyed on.

    The plain map and the prefix / suffix recomputes: the variant's name (their positions follow from the
    spec alone).  A selective variant: every field of the spec by value (a changed default never lets an old
    result pass for the new spec) and the sha256 of the selector's code (:mod:`kvhub.serving.recompute`), so
    a selector that would choose other tokens scores the items again, without a revision to bump.
    """
    if not spec.selective:
        return spec.name()
    return json_sha256({"spec": spec.options(), "selector": _selector_sha256()})


@functools.lru_cache(maxsize=1)
def _selector_sha256() -> str:
    import kvhub.serving.recompute as recompute

    return hashlib.sha256(Path(recompute.__file__).read_bytes()).hexdigest()


def item_key(item) -> str:
    """``id#<sha256 of the item's content>``: a result is reused only for the very item it scored, so a
    change in how items are built (texts, depths, tokenisation) never serves a stale score."""
    return f"{item.id}#{hashlib.sha256(repr(item).encode()).hexdigest()[:12]}"


def read_done(path: Path, from_dict: Callable[[dict], object]) -> dict:
    """Item id -> score already in ``path``."""
    done = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
                done[record["id"]] = from_dict(record["score"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
    return done


def score_items(
    items, paths: list[Path], scorer, *, from_dict: Callable[[dict], object], progress: Progress | None = None
) -> list[list]:
    """Per item, one score per variant (``paths[i]`` caches variant i).

    ``scorer(item, indices)`` scores the variants an item still lacks (returns one score per index,
    each with ``as_dict()``); each result is appended to its variant's file at once.
    """
    done = [read_done(path, from_dict) for path in paths]
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
    handles = [path.open("a") for path in paths]
    scores = []
    try:
        for index, item in enumerate(items):
            report(
                progress, "items", index, len(items)
            )  # an item's id ('0', 'hellaswag/validation/548') reads as noise
            key = item_key(item)
            missing = [i for i in range(len(paths)) if key not in done[i]]
            if missing:
                for i, score in zip(missing, scorer(item, missing)):
                    done[i][key] = score
                    handles[i].write(json.dumps({"id": key, "score": score.as_dict()}) + "\n")
                    handles[i].flush()
            scores.append([done[i][key] for i in range(len(paths))])
        report(progress, "items", len(items), len(items))
    finally:
        for handle in handles:
            handle.close()
    return scores
