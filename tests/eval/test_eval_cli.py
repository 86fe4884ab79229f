"""`kvhub eval` and `kvhub bench` through CliRunner on the tiny family: the recompute options (--exact-budget,
--select, --variant) make the variants every task scores (ppl included), bench times the recompute it is
given, and what the inputs already decide is refused before any model loads (U5, U29)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from kvhub.cli.main import main
from tests.fixtures_calib import registered_tiny_family, tiny_items, tiny_passages

ITEMS = tiny_items(2)
PASSAGES = tiny_passages(40)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(ref, db) of an exact tiny family's mapper fitted on random ids, registered in a fresh store."""
    ref, db, *_ = registered_tiny_family(tmp_path_factory.mktemp("evalcli"))
    return ref, db


@pytest.fixture
def env(pair, tmp_path, monkeypatch):
    import kvhub.eval.tasks as tasks
    import kvhub.eval.textsets as textsets

    monkeypatch.setenv("KVHUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tasks, "load_task", lambda name, limit=None, seed=0: ITEMS[:limit])
    monkeypatch.setattr(textsets, "_lambada_passages", lambda cache_dir: PASSAGES)
    return pair


def _run(*args):
    return CliRunner().invoke(main, list(args))


def _no_loading(monkeypatch):
    import kvhub.eval.run as run

    monkeypatch.setattr(run, "load_version", lambda *a, **k: pytest.fail("models loaded before the refusal"))


def test_recompute_options_make_the_variants_every_task_scores(env):
    """--exact-prefix x --exact-budget x --select make the product (the selector only where the budget is > 0),
    --variant adds a spec ('handoff': kvhub.handoff's defaults), and every task, ppl included, scores each one,
    labelled with its own fields.  Planted bugs caught: --select beyond the first ignored, --variant ignored,
    ppl dropping selective variants, summaries labelled from another variant."""
    ref, db = env
    result = _run(
        "eval",
        ref,
        "--db",
        db,
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--task",
        "hellaswag",
        "--task",
        "ppl",
        "--limit",
        "2",
        "--ppl-seq-len",
        "24",
        "--exact-prefix",
        "1",
        "--exact-budget",
        "0",
        "--exact-budget",
        "0.5",
        "--select",
        "source",
        "--select",
        "random",
        "--variant",
        "handoff",
        "--json",
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    expected = {
        "exact_prefix=1": (1, 0, 0.0, None),
        "exact_prefix=1,exact_budget=0.5,select=source": (1, 0, 0.5, "source"),
        "exact_prefix=1,exact_budget=0.5,select=random": (1, 0, 0.5, "random"),
        "exact_prefix=4,exact_suffix=16,exact_budget=0.08,select=source": (4, 16, 0.08, "source"),
    }
    assert [v["name"] for v in doc["config"]["variants"]] == list(expected)
    for task in ("hellaswag", "ppl:lambada/24"):
        for name, fields in expected.items():
            summary = doc["results"][f"{task}@{name}"]
            assert (
                summary["exact_prefix"],
                summary["exact_suffix"],
                summary["exact_budget"],
                summary["select"],
            ) == fields and summary["variant"] == name
            assert summary["n"] == 2
    for name in expected:  # an exact family: the handoff scores as the target's own cache
        assert doc["results"][f"hellaswag@{name}"]["acc_mapped"] == doc["results"][f"hellaswag@{name}"]["acc_own"]
        ppl = doc["results"][f"ppl:lambada/24@{name}"]
        assert ppl["ppl_mapped"] == pytest.approx(ppl["ppl_own"], rel=1e-3)


def test_bench_times_the_recompute_it_is_given(env, monkeypatch):
    """`kvhub bench --exact-budget 0.25 --select random` escalates every handoff with that spec and stores the
    timings under its name.  Planted bug caught: bench dropping --exact-budget or --select."""
    import kvhub.eval.continuation as continuation

    ref, db = env
    seen = []
    real = continuation.escalate
    monkeypatch.setattr(continuation, "escalate", lambda *a, **k: (seen.append(k["recompute"]), real(*a, **k))[1])
    result = _run(
        "bench",
        ref,
        "--db",
        db,
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--lengths",
        "16,24",
        "--repeats",
        "1",
        "--exact-budget",
        "0.25",
        "--select",
        "random",
        "--json",
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [row["tokens"] for row in doc["rows"]] == [16, 24]
    assert doc["variant"]["name"] == "exact_budget=0.25,select=random"
    assert seen and {(s.exact_budget, s.select) for s in seen} == {(0.25, "random")}
    shown = json.loads(_run("show", ref, "--db", db, "--json").stdout)
    assert "bench:cpu:float32:16@exact_budget=0.25,select=random" in json.dumps(shown)
    spec = _run(
        "bench",
        ref,
        "--db",
        db,
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--lengths",
        "16",
        "--repeats",
        "1",
        "--variant",
        "exact_suffix=2,exact_budget=0.5,select=target,queries=2",
        "--json",
    )
    assert spec.exit_code == 0, spec.output
    assert (seen[-1].exact_suffix, seen[-1].exact_budget, seen[-1].select, seen[-1].queries) == (2, 0.5, "target", 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("command", ["eval", "bench"])
def test_cuda_on_a_machine_without_it_is_one_line_and_exit_2(env, monkeypatch, command):
    """U5: not a pin_memory traceback after loading, but the fix, before any model loads."""
    _no_loading(monkeypatch)
    ref, db = env
    extra = ["--task", "hellaswag"] if command == "eval" else []
    result = _run(command, ref, "--db", db, "--device", "cuda", *extra)
    assert result.exit_code == 2, result.output
    assert "CUDA is not available here; use --device cpu" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("lengths", ["64k", "1024,x", "1e3", "0"])
def test_bench_lengths_that_are_not_token_counts_are_a_usage_error(env, monkeypatch, lengths):
    """U5: `--lengths 64k` says what to write instead of `ValueError: invalid literal for int()`."""
    _no_loading(monkeypatch)
    ref, db = env
    result = _run("bench", ref, "--db", db, "--lengths", lengths)
    assert result.exit_code == 2 and "e.g. --lengths 1024,4096,65536" in result.output, result.output


def test_a_context_longer_than_the_models_is_refused_before_loading(env, monkeypatch):
    """U29: the tiny pair holds 512 positions; --context-tokens 1024 would score positions it never saw."""
    _no_loading(monkeypatch)
    ref, db = env
    result = _run("eval", ref, "--db", db, "--task", "facts", "--context-tokens", "256", "--context-tokens", "1024")
    assert result.exit_code == 2, result.output
    assert "--context-tokens 1024 exceeds" in result.output and "512" in result.output


def test_bench_shows_how_far_it_is(env, monkeypatch):
    """`kvhub bench` reports each length and repeat as it goes (off a terminal: plain lines on stderr), counted
    over the whole run, so a 25-minute bench is not silent after `loading`; the table on stdout is unchanged.

    Planted bugs caught: no progress at all (ux-4 U4-10: nothing for 25 minutes); a step per length (the count
    restarting, no eta for the run); the repeat number off by one or the length not named; progress on stdout."""
    ref, db = env
    monkeypatch.setenv("KVHUB_PROGRESS_INTERVAL", "0")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    result = _run(
        "bench", ref, "--db", db, "--device", "cpu", "--dtype", "float32", "--lengths", "16,24", "--repeats", "2"
    )
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("bench:")]
    assert lines[0].startswith("bench: 16 tokens, warm-up: 0/4 (0%)"), lines
    assert any(line.startswith("bench: 16 tokens, repeat 1/2: 1/4 (25%)") for line in lines), lines
    assert any(line.startswith("bench: 24 tokens, repeat 1/2: 3/4 (75%)") for line in lines), lines
    assert lines[-1].startswith("bench: 24 tokens, repeat 2/2: 4/4 (100%)"), lines
    assert "bench:" not in result.stdout and "tokens" in result.stdout.splitlines()[1]
