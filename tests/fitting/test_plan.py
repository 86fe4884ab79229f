"""kvhub plan: known answers for its formulas (bytes KVStats allocates, parameters of a built model,
FLOPs counted by torch), its advice, the CLI, and kvhub fit refusing what the machine cannot hold."""

import dataclasses
import json

import pytest
import torch
from click.testing import CliRunner
from torch.utils.flop_counter import FlopCounterMode

from kvhub.cli.main import main
from kvhub.errors import ConfigError
from kvhub.fitting.job import FitRequest, check_plan, plan_for
from kvhub.fitting.modes import StatisticsMode, statistics_bytes
from kvhub.fitting.options import FitOptions
from kvhub.fitting.plan import DeviceProfile, ModelShape, Workload, load_config, plan_fit, recommend, shape_of
from kvhub.core.stats import KVStats, Layout
from tests.tinymodels import make_model


def _allocated(stats: KVStats) -> int:
    return sum(t.nbytes for m in (stats.k, stats.v) for t in (m.mean_x, m.mean_y, m.cxx, m.cxy, m.syy))


@pytest.mark.parametrize("owned", [3, 1])
@pytest.mark.parametrize(
    "gram,dtype", [("full", "float64"), ("diagonal", "float64"), ("full", "float32"), ("diagonal", "float32")]
)
def test_statistics_bytes_equal_what_kvstats_allocates(owned, gram, dtype):
    layout = Layout(src_layers=2, src_width=24, dst_layers=owned, dst_width=40)
    torch_dtype = getattr(torch, dtype)
    train, heldout = (KVStats(layout, gram=gram, dtype=torch_dtype) for _ in range(2))
    entries = 2 * 24 * 24 if gram == "diagonal" else None  # Ls * ds^2 stored Gram entries
    expected = statistics_bytes(2 * 24, owned * 40, gram_entries=entries, dtype=dtype)
    assert expected == _allocated(train) + _allocated(heldout) == train.nbytes() + heldout.nbytes()
    if (gram, dtype) == ("full", "float64"):  # the one-pass fp64 formula, written out
        assert expected == 2 * 2 * 8 * (48 + 48 * 48 + 48 * owned * 40 + 2 * owned * 40)


@pytest.mark.parametrize(
    "model_type,overrides",
    [
        ("qwen2", {}),
        ("qwen2", {"tie_word_embeddings": True}),
        ("qwen3", {"head_dim": 16}),
        ("llama", {"num_key_value_heads": 1}),
    ],
)
def test_parameters_equal_a_built_models(model_type, overrides):
    model = make_model(model_type, **overrides)
    shape = ModelShape.from_config(model.config.to_dict())
    assert shape.parameters() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_forward_flops_equal_torchs_count(model_type):
    model = make_model(model_type, head_dim=16) if model_type == "qwen3" else make_model(model_type)
    tokens = 40
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model.base_model(input_ids=torch.zeros(1, tokens, dtype=torch.long))
    shape = ModelShape.from_config(model.config.to_dict())
    assert counter.get_total_flops() == shape.forward_flops(tokens)


def test_shipped_configs_give_the_real_shapes():
    small, large = shape_of("Qwen/Qwen3-14B"), shape_of("qwen3-32b")
    assert (small.layers, small.kv_width, large.layers, large.kv_width) == (40, 1024, 64, 1024)
    assert round(small.parameters() / 1e9, 1) == 14.8 and round(large.parameters() / 1e9, 1) == 32.8
    plan = plan_fit(small, large, Workload(), DeviceProfile("x", 10**15, 1e15, 1e14, 1e14, 1e11))
    # the arithmetic: (40,960^2 + 40,960 x 65,536) fp64, K and V, train and held-out: ~140 GB
    assert 139e9 < plan.memory["statistics"] < 141e9


def _tiny_pair():
    return (
        ModelShape("s", "qwen2", 2, 64, 4, 2, 16, 128, 128, False, True, False),
        ModelShape("t", "qwen2", 4, 64, 4, 2, 32, 128, 128, False, True, False),
    )


def test_advice_names_the_rank_count_that_fits():
    source, target = _tiny_pair()
    workload = Workload(samples=8, heldout=2, seq_len=32, stride=1, batch_size=1, k=1, dtype="float32")
    node = dict(
        memory=10**12,
        bf16=1e9,
        fp32=1e9,
        fp64=1e9,
        link=1e9,
        gpu=True,
        host_fp32=1e9,
        host_fp64=1e9,
        devices_per_host=1,
    )  # one GPU per node: sharding divides each node's statistics
    one, two = (
        plan_fit(source, target, workload, DeviceProfile("x", host_memory=10**12, **node), ranks=r) for r in (1, 2)
    )
    assert two.memory["host_peak"] < one.memory["host_peak"] and two.memory["weights"] == one.memory["weights"]
    device = DeviceProfile("small-host", host_memory=(one.memory["host_peak"] + two.memory["host_peak"]) // 2, **node)
    chosen = recommend(source, target, workload, device)  # fp32 totals on one rank before fp64 on two
    assert (chosen.ranks, chosen.mode, chosen.statistics, chosen.fits) == (
        1,
        "full",
        StatisticsMode(dtype="float32"),
        True,
    )
    fp64 = StatisticsMode()
    assert recommend(source, target, workload, dataclasses.replace(device, host_memory=1)).ranks == 8
    refused = plan_fit(source, target, workload, device, ranks=1, statistics=fp64)
    assert not refused.fits and "on 2 ranks" in refused.advice and "torchrun --nproc-per-node 2" in refused.advice
    assert plan_fit(source, target, workload, device, ranks=2, statistics=fp64).fits
    nothing = recommend(source, target, workload, DeviceProfile("tiny", host_memory=1000, **node))
    assert not nothing.fits and "no rank count fits, not even with two-pass statistics" in nothing.advice
    cpu = DeviceProfile("cpu", one.memory["peak"] * 2 - 1, 1e9, 1e9, 1e9, 1e9)  # CPU ranks share one memory
    assert plan_fit(source, target, workload, cpu, ranks=1).fits
    assert not plan_fit(source, target, workload, cpu, ranks=2, statistics=fp64).fits


def test_load_config_reads_paths_and_refuses_unknown_ids(tmp_path):
    model = make_model("qwen2")
    model.config.save_pretrained(tmp_path / "m")
    assert load_config(str(tmp_path / "m"))[0]["num_hidden_layers"] == 3
    assert load_config(str(tmp_path / "m" / "config.json"))[0]["hidden_size"] == 64
    with pytest.raises(ConfigError, match="Qwen/Qwen3-14B"):
        load_config("nobody/no-such-model")


def test_plan_cli_json_and_table(tmp_path):
    make_model("qwen2").config.save_pretrained(tmp_path / "src")
    runner = CliRunner()
    args = ["plan", "--src", str(tmp_path / "src"), "--dst", "Qwen/Qwen2.5-Coder-1.5B-Instruct", "--device", "cpu"]
    result = runner.invoke(main, args + ["--samples", "8", "--ranks", "2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["ranks"] == 2 and data["workload"]["heldout"] == 2  # the recipes' 20% share
    memory = data["memory"]
    assert memory["device_peak"] == memory["weights"] + memory["activations"] + memory["exchange"]
    assert memory["host_peak"] == memory["statistics"] + max(memory["update"], memory["solve"])
    table = runner.invoke(main, args)
    assert table.exit_code == 0 and "memory per rank" in table.output and "mode full" in table.output
    bad = runner.invoke(main, ["plan", "--src", "nobody/none", "--dst", "Qwen/Qwen3-32B"])
    assert bad.exit_code == 2 and "no config for 'nobody/none'" in bad.output


def test_fit_refuses_early_with_the_plans_advice(tmp_path, text_corpus):
    model = make_model("qwen2")
    for name in ("src", "dst"):
        model.config.save_pretrained(tmp_path / name)  # configs only: a refusal must not load weights
    request = FitRequest(
        src=str(tmp_path / "src"),
        dst=str(tmp_path / "dst"),
        calib=str(text_corpus),
        samples=4,
        seq_len=16,
        dtype="float32",
        device="cpu",
        options=FitOptions(capture="one-phase"),  # both models resident: the statistics' own fallbacks first
    )
    plan = plan_for(request, available=10**12)
    assert plan.fits and plan.workload.samples == 4 and plan.workload.seq_len == 16 and plan.statistics.passes == 1
    lean = check_plan(request, available=plan.memory["peak"] - 1)  # auto: fp32 totals, still one pass
    assert lean.fits and lean.statistics == StatisticsMode(dtype="float32")
    two = check_plan(request, available=lean.memory["peak"] - 1)  # auto: two passes
    assert two.fits and two.statistics.passes == 2 and two.memory["peak"] < lean.memory["peak"]
    one_pass = dataclasses.replace(request, options=FitOptions(statistics="one-pass", capture="one-phase"))
    with pytest.raises(ConfigError, match="does not fit.*one model resident at a time it fits: kvhub fit --capture"):
        check_plan(one_pass, available=lean.memory["peak"] - 1)
    phased = check_plan(
        dataclasses.replace(request, options=FitOptions(statistics="one-pass")), available=lean.memory["peak"] - 1
    )
    assert phased.capture == "two-phase" and phased.memory["weights"] == lean.memory["weights"] // 2  # twin configs
    assert phased.memory["spool"] > 0 and phased.seconds["spool"] > 0 and "spool" not in lean.seconds
    only_two_phase = dataclasses.replace(request, options=FitOptions(statistics="one-pass", capture="two-phase"))
    lean_phased = check_plan(only_two_phase, available=phased.memory["peak"] - 1)
    assert lean_phased.statistics == StatisticsMode(dtype="float32") and lean_phased.capture == "two-phase"
    with pytest.raises(ConfigError, match="does not fit.*two-pass statistics fit.*kvhub plan --src"):
        check_plan(only_two_phase, available=lean_phased.memory["peak"] - 1)
    with pytest.raises(ConfigError, match="not even with two-pass statistics"):
        check_plan(request, available=two.memory["weights"])


def test_two_passes_keep_the_most_candidates_that_fit():
    """Qwen3-14B -> 32B on an H200 whose host has 64 GiB: one pass fits in neither fp64 nor fp32; two
    passes keep as many candidate source layers as fit, and one more would not."""
    from kvhub.fitting.plan import GIB, device_profile, workload_for

    small, large = shape_of("Qwen/Qwen3-14B"), shape_of("Qwen/Qwen3-32B")
    workload = workload_for(samples=256, seq_len=2048)
    device = dataclasses.replace(device_profile("h200"), host_memory=64 * GIB)
    plan = plan_fit(small, large, workload, device)
    mode = plan.statistics
    assert plan.fits and mode.passes == 2 and 1 <= mode.candidates < small.layers
    assert mode.top_k_max <= mode.candidates and mode.top_k_max in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
    for dtype in ("float64", "float32"):
        assert not plan_fit(small, large, workload, device, statistics=StatisticsMode(dtype=dtype)).fits
        more = StatisticsMode(passes=2, dtype=dtype, candidates=mode.candidates + 1, top_k_max=mode.top_k_max)
        assert not plan_fit(small, large, workload, device, statistics=more).fits
    p, q, ds = 40 * 1024, 64 * 1024, 1024  # pass 1: diagonal blocks + the whole cross block; pass 2: c layers
    assert plan.memory["statistics_pass1"] == statistics_bytes(p, q, gram_entries=p * ds, dtype=mode.dtype)
    assert plan.memory["statistics_pass2"] == statistics_bytes(mode.candidates * ds, q, dtype=mode.dtype)
    assert plan.memory["statistics"] == max(plan.memory["statistics_pass1"], plan.memory["statistics_pass2"])
    assert "two passes" in plan.advice and "in one pass" in plan.advice
    with pytest.raises(ConfigError, match="--candidates applies to two-pass"):
        plan_fit(small, large, workload, device, statistics="one-pass", candidates=4)
    forced = plan_fit(small, large, workload, device, statistics="two-pass", candidates=mode.candidates - 1)
    assert forced.fits and forced.statistics.candidates == mode.candidates - 1


def test_plan_cli_shows_the_two_pass_statistics():
    runner = CliRunner()
    pair = ["plan", "--src", "Qwen/Qwen3-14B", "--dst", "Qwen/Qwen3-32B", "--device", "h200"]
    result = runner.invoke(
        main, [*pair, "--samples", "256", "--seq-len", "2048", "--host-memory", "64", "--ranks", "1"]
    )
    assert result.exit_code == 0, result.output
    assert "statistics, pass 1" in result.output and "statistics: two passes" in result.output
    data = json.loads(runner.invoke(main, [*pair, "--stats", "one-pass", "--json"]).stdout)
    assert data["statistics"] == {"passes": 1, "dtype": "float64", "candidates": None, "top_k_max": None}


@pytest.mark.parametrize("capacity", [10_000, 50])
def test_mlp_row_samples_are_what_the_reservoirs_allocate(capacity):
    """--map mlp keeps rows for its MLPs (kvhub.fitting.samples) to the end of the fit: the plan counts exactly
    the bytes those reservoirs allocate (all rows, or --mlp-tokens per split), in the host peak; ridge keeps none."""
    from kvhub.fitting.samples import reservoirs

    src, dst = (
        ModelShape.from_config(make_model("qwen2").config.to_dict()),
        shape_of("Qwen/Qwen2.5-Coder-1.5B-Instruct"),
    )
    layout = Layout(src_layers=src.layers, src_width=src.kv_width, dst_layers=dst.layers, dst_width=dst.kv_width)
    splits = {"train": torch.zeros(6, 40, dtype=torch.long), "heldout": torch.zeros(2, 40, dtype=torch.long)}
    kept = reservoirs(layout, splits, capacity=capacity, stride=3, skip_first=0)
    allocated = sum(t.nbytes for r in kept.values() for t in r.tensors.values())
    device = DeviceProfile("cpu", memory=64 * 2**30, bf16=1e11, fp32=1e11, fp64=5e10, link=1e9)
    base = Workload(samples=6, heldout=2, seq_len=40, stride=3)
    ridge = plan_fit(src, dst, base, device)
    mlp = plan_fit(src, dst, dataclasses.replace(base, mlp_tokens=capacity), device)
    assert ridge.memory["samples"] == 0
    assert mlp.memory["samples"] == allocated > 0
    assert mlp.memory["host_peak"] - ridge.memory["host_peak"] == allocated


def test_plan_cli_counts_the_mlp_row_samples(tmp_path):
    make_model("qwen2").config.save_pretrained(tmp_path / "src")
    args = ["plan", "--src", str(tmp_path / "src"), "--dst", "Qwen/Qwen2.5-Coder-1.5B-Instruct", "--device", "cpu"]
    runner = CliRunner()
    ridge = json.loads(runner.invoke(main, args + ["--json"]).stdout)
    mlp = json.loads(runner.invoke(main, args + ["--map", "mlp", "--mlp-tokens", "1024", "--json"]).stdout)
    assert ridge["memory"]["samples"] == 0 and mlp["workload"]["mlp_tokens"] == 1024
    assert mlp["memory"]["samples"] > 0
    table = runner.invoke(main, args + ["--map", "mlp"])
    assert table.exit_code == 0 and "MLP row samples" in table.output
    assert "MLP row samples" not in runner.invoke(main, args).output


def test_the_papers_pair_and_a_70b_target_fit_the_hardware_teams_have():
    """Qwen3-14B -> 32B on 8 x H100 fits only with one model resident at a time; Llama-3.1-8B -> 70B fits one
    H100, or 8, only with the target run layer by layer (the target's weights wait on the host)."""
    from kvhub.fitting.plan import DEVICES, recommend, shape_of, workload_for

    h100, workload = DEVICES["h100"], workload_for()
    qwen = [shape_of("Qwen/Qwen3-14B"), shape_of("Qwen/Qwen3-32B")]
    assert not plan_fit(*qwen, workload, h100, ranks=8, capture="one-phase").fits
    paper = plan_fit(*qwen, workload, h100, ranks=8, capture="auto")
    assert paper.fits and paper.capture == "two-phase" and paper.target_layout == "whole"
    assert paper.memory["weights"] == qwen[1].parameters() * 2 and paper.memory["spool"] > 0
    llama = [shape_of("meta-llama/Llama-3.1-8B"), shape_of("meta-llama/Llama-3.1-70B")]
    assert not plan_fit(*llama, workload, h100, ranks=1, capture="auto").fits
    outer = recommend(*llama, workload, h100, capture="auto", target_layout="auto")
    assert outer.fits and outer.ranks == 1 and outer.target_layout == "layer-outer" and outer.capture == "two-phase"
    assert outer.memory["device_peak"] < h100.memory < outer.memory["target_weights_host"]
    assert outer.seconds["onload"] > 0 and outer.seconds["spool"] > 0
    eight = plan_fit(*llama, workload, h100, ranks=8, capture="auto", target_layout="auto")
    assert eight.fits and eight.target_layout == "layer-outer" and eight.mode == "sharded"
    assert eight.memory["statistics"] < outer.memory["statistics"]  # each rank keeps its own target layers
    assert eight.memory["hidden_states"] * 8 >= outer.memory["hidden_states"]  # each rank carries its batches
    whole = plan_fit(*llama, workload, h100, ranks=8, capture="auto", target_layout="whole")
    assert not whole.fits and "kvhub fit --target-layout layer-outer" in whole.advice
