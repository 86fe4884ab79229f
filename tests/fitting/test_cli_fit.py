"""`kvhub fit` / `bench` / `report` end to end through the CLI, on tiny models saved as local dirs."""

import json

import pytest
import torch
from click.testing import CliRunner

from kvhub.cli.main import main
from tests.fixtures_calib import train_tokenizer
from tests.tinymodels import make_model
from tests.tolerances import rtol
from tests.fixtures_fit import tiny_fit_args


@pytest.fixture
def env(tmp_path, monkeypatch, text_corpus):
    monkeypatch.setenv("KVHUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KVHUB_HOME", str(tmp_path / "home"))
    return {"db": f"sqlite:///{tmp_path / 'store.db'}", "corpus": text_corpus, "tmp": tmp_path}


def _fit_args(tiny_model_dirs, env, out):
    src, dst = tiny_model_dirs
    return tiny_fit_args(src, dst, calib=env["corpus"], lambda_="1e-9", batch_size=1, db=env["db"], out=out)


def test_fit_registers_exports_and_reports(tiny_model_dirs, env):
    runner = CliRunner()
    out = env["tmp"] / "exported"
    result = runner.invoke(main, _fit_args(tiny_model_dirs, env, out) + ["--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["ref"].endswith("@v1")
    # an exact family: R^2 is 1 up to fp32 moment products over at most the 12 x 24 calibration tokens
    assert abs(1 - summary["metrics"]["heldout_r2_k_mean"]) < rtol(torch.float32, terms=12 * 24)
    assert (out / "mapper.safetensors").is_file() and (out / "mapper.json").is_file()
    listed = json.loads(runner.invoke(main, ["list", "--db", env["db"], "--json"]).stdout)
    assert len(listed) == 1
    ref = summary["ref"]
    bench = runner.invoke(
        main,
        [
            "bench",
            ref,
            "--lengths",
            "16,24",
            "--repeats",
            "1",
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--db",
            env["db"],
            "--json",
        ],
    )
    assert bench.exit_code == 0, bench.output
    rows = json.loads(bench.stdout)["rows"]
    assert [r["tokens"] for r in rows] == [16, 24] and all(r["speedup"] > 0 for r in rows)
    levers = runner.invoke(
        main,
        [
            "bench",
            ref,
            "--lengths",
            "16",
            "--repeats",
            "1",
            "--dtype",
            "float32",
            "--exact-prefix",
            "1",
            "--exact-suffix",
            "3",
            "--device",
            "cpu",
            "--db",
            env["db"],
            "--json",
        ],
    )
    assert levers.exit_code == 0, levers.output
    assert json.loads(levers.stdout)["exact_suffix"] == 3
    report = runner.invoke(main, ["report", ref, "--out", str(env["tmp"] / "report"), "--db", env["db"]])
    assert report.exit_code == 0, report.output
    for name in ("r2_heatmap.png", "layer_r2.png", "report.md"):
        assert (env["tmp"] / "report" / name).stat().st_size > 0


def test_fit_with_compressed_maps_and_attention_weighting(tiny_model_dirs, env):
    runner = CliRunner()
    out = env["tmp"] / "compressed"
    args = _fit_args(tiny_model_dirs, env, out) + ["--head-local", "--rank", "8", "--weighting", "attention", "--json"]
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    metadata = json.loads((out / "mapper.json").read_text())
    assert metadata["format_version"] == 3 and metadata["structure"]["rank"] == 8  # 3: target_mean stored
    assert metadata["structure"]["head_groups"] > 1 and metadata["fit"]["weighting"] == "attention"
    assert any(
        name.endswith(".weight_a")
        for name in __import__("safetensors").safe_open(str(out / "mapper.safetensors"), "pt").keys()
    )
    bad = runner.invoke(main, _fit_args(tiny_model_dirs, env, env["tmp"] / "bad") + ["--rank", "0"])
    assert bad.exit_code != 0 and "--rank" in bad.output


def test_interrupted_fit_leaves_nothing_and_resumes(tiny_model_dirs, env, monkeypatch):
    import kvhub.fitting.fit as fit_module

    runner = CliRunner()
    out = env["tmp"] / "out"
    real = fit_module._accumulate_batch
    calls = []

    def dies_after_six(*args, **kwargs):
        calls.append(1)
        if len(calls) > 6:
            raise KeyboardInterrupt  # what Ctrl-C or a kill looks like to the code below
        return real(*args, **kwargs)

    monkeypatch.setattr(fit_module, "_accumulate_batch", dies_after_six)
    result = runner.invoke(main, _fit_args(tiny_model_dirs, env, out))
    assert result.exit_code == 130  # SIGINT's status, not click's "Aborted!" (1)
    assert "Interrupted at batch 7/15; run the same command to resume (--restart to start over)" in result.stderr
    assert not out.exists()
    listed = runner.invoke(main, ["list", "--db", env["db"], "--json"])  # nothing registered: not even a store
    assert listed.exit_code == 6 and "no kvhub store" in listed.output
    checkpoints = list((env["tmp"] / "cache" / "checkpoints").glob("*.safetensors"))
    assert len(checkpoints) == 1

    calls.clear()
    monkeypatch.setattr(fit_module, "_accumulate_batch", lambda *a, **k: (calls.append(1), real(*a, **k)))
    result = runner.invoke(main, _fit_args(tiny_model_dirs, env, out))
    assert result.exit_code == 0, result.output
    assert "resuming from checkpoint (4/15 batches done)" in result.stderr
    assert len(calls) == 15 - 4  # 12 train + 3 held-out batches, 4 of them restored from the checkpoint
    assert out.is_dir() and not checkpoints[0].exists()


def test_fit_refuses_existing_out_and_different_tokenizers(tiny_model_dirs, env, tmp_path):
    runner = CliRunner()
    (tmp_path / "taken").mkdir()
    result = runner.invoke(main, _fit_args(tiny_model_dirs, env, tmp_path / "taken"))
    assert result.exit_code == 2 and "already exists" in result.output
    other = tmp_path / "other"
    make_model("qwen2", vocab_size=640, num_hidden_layers=2).save_pretrained(other)
    train_tokenizer(vocab_size=620).save_pretrained(other)
    args = _fit_args(tiny_model_dirs, env, tmp_path / "new")
    args[args.index("--dst") + 1] = str(other)
    result = runner.invoke(main, args)
    assert result.exit_code == 3 and "different tokenizers" in result.output


def test_eval_stores_metrics_and_resumes_from_item_cache(tiny_model_dirs, env, monkeypatch):
    import kvhub.eval.taskeval as taskeval
    import kvhub.eval.tasks as tasks
    from kvhub.eval.tasks import Item

    runner = CliRunner()
    fitted = runner.invoke(main, _fit_args(tiny_model_dirs, env, env["tmp"] / "m") + ["--json"])
    ref = json.loads(fitted.stdout)["ref"]
    # contexts made of the calibration corpus' own words: the fitted map is exact on their span
    items = [
        Item(
            context=f"d00{i} d00{i} d011 d011 d012",
            continuations=[" d013", " d020 d020", " d033"],
            label=i % 3,
            id=str(i),
        )
        for i in range(4)
    ]
    monkeypatch.setattr(tasks, "load_task", lambda name, limit=None, seed=0: items[:limit])
    calls = []
    real = taskeval.score_item
    monkeypatch.setattr(
        taskeval, "score_item", lambda item, **kw: (calls.append((item.id, kw["variants"])), real(item, **kw))[1]
    )
    args = [
        "eval",
        ref,
        "--task",
        "hellaswag",
        "--limit",
        "4",
        "--exact-prefix",
        "0",
        "--exact-prefix",
        "2",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--db",
        env["db"],
        "--json",
    ]
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    results = json.loads(result.stdout)["results"]
    exact = results["hellaswag"]
    assert exact["n"] == 4 and exact["acc_own"] in (0, 0.25, 0.5, 0.75, 1) and 0 <= exact["agree_next"] <= 1
    assert "hellaswag@exact_prefix=2" in results
    assert len(calls) == 4
    again = runner.invoke(main, args)
    assert again.exit_code == 0 and len(calls) == 4  # every item came from the per-item cache
    more = runner.invoke(main, args + ["--exact-suffix", "0", "--exact-suffix", "1"])
    assert more.exit_code == 0, more.output
    assert "hellaswag@exact_prefix=2,exact_suffix=1" in json.loads(more.stdout)["results"]
    new = [[(v.exact_prefix, v.exact_suffix) for v in variants] for _, variants in calls[4:]]
    assert [item for item, _ in calls[4:]] == [str(i) for i in range(4)]
    assert new == [[(0, 1), (2, 1)]] * 4  # only the new variants were scored
    shown = json.loads(runner.invoke(main, ["show", ref, "--db", env["db"], "--json"]).stdout)
    names = {(m["task"], m["name"]) for m in shown["metrics"]}
    assert ("hellaswag", "retention") in names and ("hellaswag@exact_prefix=2", "acc_mapped") in names


def test_fit_in_two_passes_and_refuses_candidates_in_one(tiny_model_dirs, env):
    """--stats two-pass: the plan's candidate budget, the mode in mapper.json, still exact on an exact family."""
    runner = CliRunner()
    out = env["tmp"] / "two-pass"
    result = runner.invoke(main, _fit_args(tiny_model_dirs, env, out) + ["--stats", "two-pass", "--k", "1", "--json"])
    assert result.exit_code == 0, result.output
    assert "plan: statistics: two passes, float64" in result.stderr
    summary = json.loads(result.stdout)
    assert summary["statistics"] == {"passes": 2, "dtype": "float64", "candidates": 2, "top_k_max": 1}
    assert abs(1 - summary["metrics"]["heldout_r2_k_mean"]) < rtol(torch.float32, terms=12 * 24)
    metadata = json.loads((out / "mapper.json").read_text())
    assert any(note.startswith("two-pass statistics (float64)") for note in metadata["notes"])
    refused = runner.invoke(
        main, _fit_args(tiny_model_dirs, env, env["tmp"] / "no") + ["--stats", "one-pass", "--candidates", "2"]
    )
    assert refused.exit_code == 2 and "--candidates" in refused.output


def test_the_series_name_is_part_of_the_fit_request(tiny_model_dirs, env):
    """A Python caller names the series (``FitRequest.name``) as ``kvhub fit --name`` does, and the fitted
    mapper.json carries it in ``calibration.series``, beside the set's own ``calibration.name``.  Planted bugs
    caught: the name applied only by the CLI after the fit (a library fit filed under the calibration set's
    own name); the name dropped by ``prepare``; the series written over the set's name."""
    from kvhub.fitting.job import FitRequest, fit_by_names
    from kvhub.fitting.options import FitOptions

    src, dst = tiny_model_dirs
    request = FitRequest(
        src=str(src),
        dst=str(dst),
        calib=str(env["corpus"]),
        name="support-notes",
        samples=12,
        seq_len=24,
        dtype="float32",
        device="cpu",
        options=FitOptions(stride=1, batch_size=1),
    )
    mapper = fit_by_names(request)
    assert mapper.metadata["calibration"]["series"] == "support-notes"
    assert mapper.metadata["calibration"]["series"] != env["corpus"].stem
    assert mapper.metadata["calibration"]["name"] == env["corpus"].stem  # the set keeps its own name
