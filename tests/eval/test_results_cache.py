"""The per-item result cache: resumes, and never serves a score for an item whose content changed."""

from dataclasses import asdict, dataclass

from kvhub.eval.results_cache import score_items


@dataclass
class _Item:
    id: str
    text: str


@dataclass
class _Score:
    value: int

    def as_dict(self):
        return asdict(self)


def test_cached_scores_are_reused_only_for_the_same_item_content(tmp_path):
    paths = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    calls = []

    def scorer(item, indices):
        calls.append((item.id, tuple(indices)))
        return [_Score(len(item.text) + i) for i in indices]

    def run(items):
        return score_items(items, paths, scorer, from_dict=lambda d: _Score(**d), progress=lambda *a: None)

    first = run([_Item("1", "abc"), _Item("2", "de")])
    assert [[s.value for s in row] for row in first] == [[3, 4], [2, 3]] and len(calls) == 2
    again = run([_Item("1", "abc"), _Item("2", "de")])
    assert again == first and len(calls) == 2  # both from the cache
    changed = run([_Item("1", "abc"), _Item("2", "a longer text")])  # same id, other content
    assert calls[2:] == [("2", (0, 1))] and [s.value for s in changed[1]] == [13, 14]


def test_scoring_without_a_progress_callback(tmp_path):
    """run.evaluate(progress=None) hands score_items no callback: scoring goes on without one (it raised
    TypeError: 'NoneType' object is not callable)."""
    scores = score_items(
        [_Item("1", "abc")],
        [tmp_path / "a.jsonl"],
        lambda item, indices: [_Score(7)],
        from_dict=lambda d: _Score(**d),
        progress=None,
    )
    assert [[s.value for s in row] for row in scores] == [[7]]
