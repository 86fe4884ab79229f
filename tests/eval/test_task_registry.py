"""The task registry (kvhub.eval.catalog) and the one evaluation loop: a new task is one class, registered by
``"module:Class"``, and both `kvhub eval` (the library handoff on tiny models) and `kvhub eval-serve` (the
stand-in `kvhub serve` pair of test_eval_serve) run it through kvhub.eval.run.run_task."""

from __future__ import annotations

import pytest
import torch

from kvhub.cli import eval_serve_cmd
from kvhub.errors import ConfigError
from kvhub.eval import catalog, run
from kvhub.eval.conditions import LibraryConditions
from kvhub.eval.longctx import RecallItem
from kvhub.eval.recall_tasks import RecallTask
from kvhub.eval.served import Endpoint
from kvhub.eval.served_conditions import ServedConditions
from kvhub.fitting.fit import fit
from kvhub.fitting.options import FitOptions
from kvhub.serving.recompute import Recompute
from tests.eval.test_eval_serve import LARGE_NAME, greedy, models, module_pair, pair, tokenizer, tokenizer_dir  # noqa: F401 - fixtures
from tests.tinymodels import exact_family_target, make_model

PHRASES = ["the miller crossed the river at dawn and walked on to", "the baker left the basket by the mill and"]


class PhraseTask(RecallTask):
    """A new task, all of it: items of its own (a phrase; the answer is the next few characters the scoring
    model itself writes, so `own` is exact), scored under every condition by whichever backend runs it."""

    answer_model = None  # the model whose greedy continuation is the answer (set by the test)

    def items(self) -> list[RecallItem]:
        items = []
        for index, text in enumerate(PHRASES[: self.limit]):
            prompt = self.conditions.tokenizer(f"Note {index}: {text}", add_special_tokens=False)["input_ids"]
            answer = greedy(self.answer_model, prompt, 3)
            decoded = self.conditions.tokenizer.decode(answer)
            items.append(RecallItem(f"phrase-{index}", prompt, answer, decoded, {"context_tokens": len(prompt)}))
        return items


@pytest.fixture
def registered(monkeypatch):
    """``phrase`` registered for both backends, for this test only."""
    monkeypatch.setattr(catalog, "REGISTRY", dict(catalog.REGISTRY))
    catalog.register("phrase", f"{__name__}:PhraseTask", runs_on=(catalog.LIBRARY, catalog.SERVED))
    yield "phrase"


def test_register_refuses_a_taken_name_a_bad_target_and_an_unknown_backend(monkeypatch):
    monkeypatch.setattr(catalog, "REGISTRY", dict(catalog.REGISTRY))
    with pytest.raises(ValueError, match="already registered"):
        catalog.register("facts", "kvhub.eval.recall_tasks:RecallTask")
    with pytest.raises(ValueError, match="module:Class"):
        catalog.register("new", "kvhub.eval.recall_tasks.RecallTask")
    with pytest.raises(ValueError, match="runs_on"):
        catalog.register("new", "kvhub.eval.recall_tasks:RecallTask", runs_on=("cloud",))
    assert "followup" in catalog.TASKS and "followup" not in catalog.SERVED_TASKS
    assert "turns" in catalog.SERVED_TASKS and "turns" not in catalog.TASKS
    with pytest.raises(ConfigError, match="runs on: served"):
        catalog.task_class("turns", catalog.LIBRARY)


def test_a_registered_task_runs_in_the_library_through_run_task(registered, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("KVHUB_CACHE", str(tmp_path))
    source = make_model("qwen2", num_hidden_layers=2, seed=3)
    target, _ = exact_family_target(source, insert_before=(1,), kv_repeat=2, double_head_dim=True)
    ids = torch.randint(0, 128, (24, 48), generator=torch.Generator().manual_seed(0))
    options = FitOptions(ridge_lambda=1e-9, stride=1, batch_size=8)
    mapper = fit(source, target, ids[:20], ids[20:], source_id="tiny/src", target_id="tiny/dst", options=options)
    loaded = run.LoadedVersion(None, mapper, source, target, tokenizer)
    monkeypatch.setattr(PhraseTask, "answer_model", target)
    tasks = run.build_tasks([registered], loaded, limit=2, seed=0)
    assert [type(t) for t in tasks] == [PhraseTask] and isinstance(tasks[0].conditions, LibraryConditions)
    settings = run.RunSettings("0" * 64, mapper.deshrink, log_samples=True)
    out = run.evaluate(tasks, [Recompute()], settings=settings)
    ((name, summary),) = out.results.items()
    assert name == "phrase-1024" and summary["n"] == 2 and summary["variant"] == ""  # the plain map's name
    # an exact family: the map is the target's own cache, so mapped answers as own does
    assert summary["acc_own"] == summary["acc_mapped"] == 1.0
    assert len(out.samples["phrase-1024"]) == 2 and out.datasets["phrase-1024"]["n"] == 2
    again = run.evaluate(run.build_tasks([registered], loaded, limit=2, seed=0), [Recompute()], settings=settings)
    assert again.results == out.results  # the second run reads the per-item cache


def test_the_same_task_class_runs_on_a_served_pair_through_run_task(registered, pair, models, tokenizer, monkeypatch):
    monkeypatch.setattr(PhraseTask, "answer_model", models["large"])
    small, large = Endpoint(pair.small_url, pair.small_name), Endpoint(pair.large_url, LARGE_NAME)
    conditions = ServedConditions(small, large, tokenizer, agreement_tokens=4)
    results, datasets, samples, stopped = eval_serve_cmd._evaluate(
        conditions, [registered], context_tokens=(1024,), limit=2, seed=0, log_samples=True
    )
    summary = results["phrase-1024"]
    assert stopped is None
    assert summary["n"] == 2 and summary["task"] == "phrase" and summary["transfers_reported"] == 2
    assert (summary["acc_own"], summary["acc_mapped"]) == (1.0, 1.0)
    assert datasets["phrase-1024"]["n"] == 2 and [s["doc_id"] for s in samples["phrase-1024"]] == [
        "phrase-0",
        "phrase-1",
    ]
    assert {server for server, *_ in pair.requests} == {"small", "large"}
