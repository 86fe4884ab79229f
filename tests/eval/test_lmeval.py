"""kvhub as an lm-evaluation-harness model (kvhub.eval.lmeval), offline: three local tasks (tests/lmeval/*.yaml over
small JSONL files: multiple choice, rolling log-likelihood, greedy generation) on an exact tiny family.

On an exact family the mapped cache is the target's own, so every mapped score must equal own; own must equal a
direct forward of the target, source a direct forward of the source; the no-information control must differ.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lm_eval", reason="lm_eval is not installed: pip install 'kvhub[lmeval]' (part of the dev extra)")

from tests.fixtures_calib import registered_tiny_family
from tests.tolerances import rtol

REPO = Path(__file__).resolve().parents[2]
TASKS = ["kvhub_tiny_mc", "kvhub_tiny_ppl", "kvhub_tiny_gen"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(mapper ref, db, source, target): an exact family saved as model dirs, its mapper fitted on random ids
    and registered in a fresh store."""
    return registered_tiny_family(tmp_path_factory.mktemp("lmeval"))


@pytest.fixture(scope="module")
def runs(pair, tmp_path_factory):
    """Per condition: lm_eval.simple_evaluate over the three local tasks, samples logged."""
    import datasets
    import lm_eval
    from lm_eval.tasks import TaskManager

    import kvhub.eval.lmeval  # noqa: F401  (registers --model kvhub)

    ref, db, _, _ = pair
    cache = tmp_path_factory.mktemp("hf-datasets")
    saved, datasets.config.HF_DATASETS_CACHE = datasets.config.HF_DATASETS_CACHE, str(cache)
    cwd = os.getcwd()
    os.chdir(REPO)  # the task YAMLs name their data files relative to the repository
    try:
        manager = TaskManager(include_path=str(REPO / "tests" / "lmeval"), include_defaults=False)
        out = {}
        for condition in ("own", "mapped", "source", "control"):
            args = f"mapper={ref},db={db},dtype=float32,device=cpu,condition={condition}"
            out[condition] = lm_eval.simple_evaluate(
                model="kvhub", model_args=args, tasks=TASKS, task_manager=manager, log_samples=True
            )
        return out
    finally:
        os.chdir(cwd)
        datasets.config.HF_DATASETS_CACHE = saved


def _tolerance(target, loglikelihood: float) -> float:
    """Absolute tolerance of a summed log-likelihood: each token's log p is off by the fp32 rounding of the map
    (fitted over 12 x 32 tokens) and of the target's forward, relative to itself; the sum of those errors is
    that relative error times sum |log p| = |log-likelihood| (every term is negative)."""
    config = target.config
    relative = rtol(torch.float32, terms=12 * 32) + rtol(
        torch.float32, terms=config.intermediate_size * config.num_hidden_layers
    )
    return relative * max(1.0, abs(loglikelihood))


def _loglikelihoods(run, task) -> list[list[float]]:
    """Per document, the log-likelihood of each request (choice, text or nothing)."""
    return [
        [float(r[0][0]) if isinstance(r[0], (tuple, list)) else float(r[0]) for r in s["resps"]]
        for s in sorted(run["samples"][task], key=lambda s: s["doc_id"])
    ]


def _direct(model, context: list[int], continuation: list[int]) -> float:
    """log p(continuation | context) from one plain forward of ``model`` over context + continuation."""
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logp = F.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    positions = torch.arange(len(context) - 1, ids.shape[1] - 1)
    return float(logp[positions, ids[0, positions + 1]].sum())


def _lm(pair, condition="own", **model_args):
    from kvhub.eval.lmeval import KVHubLM

    ref, db, _, _ = pair
    return KVHubLM(mapper=ref, db=db, dtype="float32", device="cpu", condition=condition, **model_args)


def test_multiple_choice_own_is_the_target_mapped_equals_own_control_differs(pair, runs):
    _, _, source, target = pair
    lm = _lm(pair)
    own, mapped, control, src = (
        _loglikelihoods(runs[c], "kvhub_tiny_mc") for c in ("own", "mapped", "control", "source")
    )
    docs = sorted(runs["own"]["samples"]["kvhub_tiny_mc"], key=lambda s: s["doc_id"])
    differ = 0
    for doc, o, m, c, s in zip(docs, own, mapped, control, src):
        for i, choice in enumerate(doc["doc"]["choices"]):
            context, continuation = lm._encode_pair(doc["doc"]["context"], choice)
            tolerance = _tolerance(target, o[i])
            assert o[i] == pytest.approx(_direct(target, context, continuation), abs=tolerance)
            assert s[i] == pytest.approx(_direct(source, context, continuation), abs=tolerance)
            assert m[i] == pytest.approx(o[i], abs=tolerance)
            differ += abs(c[i] - o[i]) > 10 * tolerance
    assert differ >= 0.8 * sum(len(o) for o in own)  # the control's cache carries nothing of the context
    assert runs["mapped"]["results"]["kvhub_tiny_mc"]["acc,none"] == runs["own"]["results"]["kvhub_tiny_mc"]["acc,none"]


def test_rolling_loglikelihood_is_a_handoff_per_chunk(pair, runs):
    _, _, _, target = pair
    lm = _lm(pair)
    texts = [s["doc"]["text"] for s in sorted(runs["own"]["samples"]["kvhub_tiny_ppl"], key=lambda s: s["doc_id"])]
    own, mapped, control = (
        [row[0] for row in _loglikelihoods(runs[c], "kvhub_tiny_ppl")] for c in ("own", "mapped", "control")
    )
    for text, o, m, c in zip(texts, own, mapped, control):
        tokens = lm.tok_encode(text)
        assert len(tokens) > lm.rolling_chunk  # some chunk continues a mapped cache
        tolerance = _tolerance(target, o)
        assert o == pytest.approx(_direct(target, [lm.prefix_token_id], tokens), abs=tolerance)
        assert m == pytest.approx(o, abs=tolerance)
        assert abs(c - o) > 10 * tolerance


def test_selective_variant_from_model_args_over_the_control_map_and_an_empty_context(pair):
    """exact_budget and select given in model_args reach the recompute, for scores and for generation: over the
    no-information control map, exact_budget=1 (the target recomputes the whole context) scores and generates
    as own, and exact_budget=0 does not.  Planted bugs caught: check_model_args dropping exact_budget (a
    Recompute of the prefix and suffix only); _score or _generate ignoring the recompute.  An empty context is
    scored after the eos token (nothing to map), as lm-eval's other models do."""
    from lm_eval.api.instance import Instance

    _, _, _, target = pair
    own = _lm(pair)
    recomputed = _lm(pair, "control", exact_budget="1.0", select="target")
    mapped_only = _lm(pair, "control")
    assert recomputed.recompute.exact_budget == 1.0 and recomputed.recompute.select == "target"
    context = "Text wrapping and filling. The TextWrapper instance attributes are public"
    requests = [
        Instance("loglikelihood", {}, args, i)
        for i, args in enumerate([(context, " width."), (context, " height and more."), ("", "import json")])
    ]
    expected, got, control = (lm.loglikelihood(requests) for lm in (own, recomputed, mapped_only))
    for (o, _), (m, _) in zip(expected, got):
        assert m == pytest.approx(o, abs=_tolerance(target, o))
    assert all(abs(c - o) > 10 * _tolerance(target, o) for (o, _), (c, _) in zip(expected[:2], control[:2]))
    tokens = own.tok_encode("import json")
    assert expected[2][0] == pytest.approx(
        _direct(target, [own.eot_token_id], tokens), abs=_tolerance(target, expected[2][0])
    )
    ids = own.tok_encode(context)
    assert recomputed._generate(ids, 6, []) == own._generate(ids, 6, []) != mapped_only._generate(ids, 6, [])


def test_rolling_chunks_predict_every_token_once_within_max_length(pair):
    lm = _lm(pair)
    lm.rolling_chunk, lm._max_length = 3, 8
    tokens = list(range(100, 117))
    chunks = lm.rolling_chunks(tokens)
    assert [t for _, predicted in chunks for t in predicted] == tokens
    for context, predicted in chunks:
        assert len(context) + len(predicted) - 1 <= lm.max_length  # what the models see
        full = [lm.prefix_token_id] + tokens
        start = full.index(predicted[0]) if predicted[0] in full else None
        assert full[start - len(context) : start] == context  # the tokens right before the chunk


def test_greedy_generation_through_the_handoff(pair, runs):
    _, _, _, target = pair
    lm = _lm(pair)
    own = [s["resps"][0][0] for s in sorted(runs["own"]["samples"]["kvhub_tiny_gen"], key=lambda s: s["doc_id"])]
    mapped = [s["resps"][0][0] for s in sorted(runs["mapped"]["samples"]["kvhub_tiny_gen"], key=lambda s: s["doc_id"])]
    control = [
        s["resps"][0][0] for s in sorted(runs["control"]["samples"]["kvhub_tiny_gen"], key=lambda s: s["doc_id"])
    ]
    assert mapped == own and control != own
    docs = sorted(runs["own"]["samples"]["kvhub_tiny_gen"], key=lambda s: s["doc_id"])
    for doc, text in zip(docs, own):
        ids = torch.tensor([lm.tok_encode(doc["doc"]["context"])])
        with torch.no_grad():
            out = target.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=6,
                do_sample=False,
                pad_token_id=lm.eot_token_id,
                eos_token_id=lm.eot_token_id,
            )
        assert text == lm.tok_decode(out[0, ids.shape[1] :].tolist()).split("\n")[0]


def test_bad_model_args_are_kvhub_errors(pair):
    from kvhub.errors import ConfigError, NotFoundError
    from kvhub.eval.lmeval import KVHubLM

    ref, db, _, _ = pair
    for args, message in (
        (dict(condition="best"), "unknown condition"),
        (dict(exact_prefix="x"), "exact_prefix"),
        (dict(exact_suffix=1.5), "exact_suffix"),
        (dict(temperature=1), "unknown model_args"),
        (dict(mapper=None), "needs the mapper"),
        (dict(select="nope"), "token selector"),
        (dict(dtype="int8"), "dtype"),
        (dict(rolling_chunk=4096), "rolling_chunk"),
        (dict(deshrink="on"), "deshrink=.on.: use one of kv, v, off"),
    ):
        with pytest.raises(ConfigError, match=message):
            KVHubLM(**{"mapper": ref, "db": db, "device": "cpu", **args})
    with pytest.raises(NotFoundError):
        KVHubLM(mapper=ref.replace("@v1", "@v9"), db=db, device="cpu")


def test_python_dash_m_runs_lm_evals_command_line(pair, tmp_path):
    """`python -m kvhub.eval.lmeval --model kvhub ...` (what `kvhub-lm-eval` runs): results written where lm-eval
    writes them; a bad model arg ends with kvhub's message and exit code, no traceback."""
    ref, db, _, _ = pair
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    base = [
        sys.executable,
        "-m",
        "kvhub.eval.lmeval",
        "--model",
        "kvhub",
        "--include_path",
        "tests/lmeval",
        "--tasks",
        "kvhub_tiny_mc",
        "--limit",
        "2",
    ]
    args = f"mapper={ref},db={db},dtype=float32,device=cpu,exact_prefix=1,exact_suffix=2"
    done = subprocess.run(
        base + ["--model_args", args, "--output_path", str(tmp_path / "out")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = list((tmp_path / "out").rglob("results_*.json"))
    assert len(results) == 1
    import json

    from lm_eval.utils import sanitize_model_name

    written = json.loads(results[0].read_text())
    assert written["config"]["model"] == "kvhub" and "acc,none" in written["results"]["kvhub_tiny_mc"]
    assert results[0].parent == tmp_path / "out" / sanitize_model_name(ref)  # named after the mapper, not at random
    assert written["model_name"] == ref
    bad = subprocess.run(
        base + ["--model_args", f"mapper={ref},db={db},condition=best"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert bad.returncode == 2 and "unknown condition 'best'" in bad.stderr and "Traceback" not in bad.stderr


def test_results_name_the_version_scored_and_its_tensors(pair, tmp_path, monkeypatch):
    """mapper= typed without a version (as `kvhub-lm-eval ... mapper=small:large:notes` is) resolves to the
    store's version; the results' config names that version (`...@v1`) and its tensors' sha256 (also as
    lm-eval's model_revision / model_sha), and the run (folder, model_name) is named after it.

    Planted bugs caught: the results naming the mapper as typed (ux-4 U4-5: v2's results written into v1's
    folder under the same name after a retag); no tensors hash; the hash of the control map instead."""
    import datasets
    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager

    import kvhub.eval.lmeval  # noqa: F401  (registers --model kvhub)
    from kvhub.store import open_store

    ref, db, _, _ = pair
    typed = ref.split("@")[0]
    with open_store(db) as store:
        sha = store.resolve(ref).tensors_sha256
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))
    monkeypatch.chdir(REPO)  # the task YAMLs name their data files relative to the repository
    tracker = EvaluationTracker()
    results = lm_eval.simple_evaluate(
        model="kvhub",
        model_args=f"mapper={typed},db={db},dtype=float32,device=cpu,condition=control",
        tasks=["kvhub_tiny_mc"],
        task_manager=TaskManager(include_path=str(REPO / "tests" / "lmeval"), include_defaults=False),
        limit=2,
        evaluation_tracker=tracker,
    )
    config = results["config"]
    assert typed != ref and config["mapper_ref"] == config["model_revision"] == ref
    assert config["mapper_tensors_sha256"] == config["model_sha"] == sha
    assert tracker.general_config_tracker.model_name == ref


@pytest.mark.parametrize("flags, want", [("avx512f avx512_bf16", "bfloat16"), ("avx512f avx2", "float32")])
def test_the_default_dtype_follows_what_the_cpu_computes_natively(tmp_path, monkeypatch, flags, want):
    """``--model kvhub`` without ``dtype``: bfloat16 where the CPU has native bf16, float32 where it emulates it (about
    3x faster there), as ``kvhub fit`` and ``eval`` choose; a given dtype is kept.  Planted bugs caught: the
    default fixed at bfloat16 (the lm-eval path slow on such CPUs), a given dtype overridden."""
    from kvhub import dtypes
    from kvhub.eval.lmeval import check_model_args

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: fpu sse2 {flags}\n")
    monkeypatch.setattr(dtypes, "CPUINFO", cpuinfo)
    assert check_model_args({"mapper": "a:b:c@v1", "device": "cpu"})["dtype"] == want
    assert check_model_args({"mapper": "a:b:c@v1", "device": "cpu", "dtype": "bfloat16"})["dtype"] == "bfloat16"
