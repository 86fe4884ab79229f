"""Two-pass statistics (kvhub.fitting.two_pass): the probe on diagonal Gram blocks, the candidate choice,
equality with the one-pass fit when the candidates hold its layers, the accumulators' bytes against the
plan, fp32 totals, the plan's choice taken by the fit, and a killed fit resumed within each pass."""

import dataclasses
import re
import weakref

import pytest
import torch

from kvhub.core.solve import candidate_sources, probe_r2, solve
from kvhub.core.stats import KVStats, Layout, Moments
from kvhub.errors import ConfigError
from kvhub.fitting import devices
from kvhub.fitting import plan as planning
from kvhub.fitting.checkpoint import FitState
from kvhub.fitting.fit import accumulate_passes, fit, fit_batches, layout_for, solve_statistics
from kvhub.fitting.options import FitOptions
from kvhub.fitting.modes import ONE_PASS, StatisticsMode
from kvhub.fitting.plan import DeviceProfile, ModelShape, Workload, plan_fit
from kvhub.fitting.two_pass import solve_candidates
from kvhub.core.solve import Structure
from tests.fixtures_fit import token_ids as _ids
from tests.tinymodels import make_model
from tests.tolerances import assert_close, rtol

BIG = DeviceProfile("big", 10**12, 1e12, 1e12, 1e12, 1e12)  # a machine every plan fits


# ---- the candidates --------------------------------------------------------------------------------
def test_candidate_sources_take_every_targets_best_first():
    # probe_k = probe_v: target 0 ranks 3 > 1 > 0 > 2 > 4, target 1 ranks 3 > 4 > 2 > 0 > 1, target 2: 0 > 2 > ...
    grid = torch.tensor([[0.7, 0.2, 0.9], [0.8, 0.1, 0.1], [0.1, 0.3, 0.8], [0.9, 0.9, 0.2], [0.0, 0.5, 0.3]])
    assert candidate_sources(grid, grid, range(3), depth=1) == [0, 3]  # best of each: 3, 3, 0
    assert candidate_sources(grid, grid, range(3), depth=2) == [0, 1, 2, 3, 4]  # seconds: 1, 4, 2
    assert candidate_sources(grid, grid, range(3), depth=2, max_layers=3) == [0, 1, 3]  # 3, 0, then target 0's 1
    assert candidate_sources(grid, grid, [1], depth=3) == [2, 3, 4]  # one rank's targets only
    assert candidate_sources(grid, grid, range(3), depth=9) == [0, 1, 2, 3, 4]  # depth past Ls: every layer
    with pytest.raises(ConfigError, match="depth and max_layers"):
        candidate_sources(grid, grid, range(3), depth=0)


def _planted(layout, n, seed):
    """Source blocks with distinct scales, each target layer a noisy map of two planted source layers."""
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, layout.src_width, generator=gen) * (1 + l) + l for l in range(layout.src_layers)]
    ys = []
    for m, pair in enumerate(((1, 5), (2, 6))[: layout.dst_layers]):
        x = torch.cat([xs[l] for l in pair], 1)
        w = torch.randn(x.shape[1], layout.dst_width, generator=torch.Generator().manual_seed(100 + m))
        ys.append(x @ w + 0.5 * torch.randn(n, layout.dst_width, generator=gen))
    return xs, ys


def _split_stats(layout, *, gram="full", sources=None, dtype=torch.float64):
    """(train, heldout) statistics of the planted data, keeping only ``sources`` (None: all)."""
    kept = list(range(layout.src_layers)) if sources is None else sources
    sub = Layout(len(kept), layout.src_width, layout.dst_layers, layout.dst_width)
    out = []
    for n, seed in ((600, 0), (200, 1)):
        stats = KVStats(sub, gram=gram, dtype=dtype)
        xs, ys = _planted(layout, n, seed)
        for start in range(0, n, 100):
            rows = [x[start : start + 100] for x in xs]
            picked = [rows[l] for l in kept]
            stats.update(picked, picked, [y[start : start + 100] for y in ys], [y[start : start + 100] for y in ys])
        out.append(stats)
    return out


LAYOUT = Layout(src_layers=8, src_width=6, dst_layers=2, dst_width=5)


def test_probe_on_diagonal_blocks_equals_probe_on_full_statistics():
    full, diagonal = _split_stats(LAYOUT), _split_stats(LAYOUT, gram="diagonal")
    for a, b in zip(probe_r2(*full), probe_r2(*diagonal)):
        assert_close(b, a, terms=800)  # the same sums, up to how the fp32 GEMM rounds a block (here: not at all)
    assert diagonal[0].nbytes() < full[0].nbytes()
    assert tuple(diagonal[0].k.cxx.shape) == (8, 6, 6)


def test_solve_on_candidates_equals_the_one_pass_solve():
    """top_k and lambda 'auto' over k <= 4: the candidates hold every target's best 4, so the two solves
    pick the same layers, k and lambdas from the same sums."""
    full = _split_stats(LAYOUT)
    one = solve(*full, top_k_grid=(1, 2, 3, 4))
    probe_k, probe_v = probe_r2(*_split_stats(LAYOUT, gram="diagonal"))
    candidates = candidate_sources(probe_k, probe_v, range(2), depth=4)
    assert len(candidates) < LAYOUT.src_layers  # a real restriction, not every layer
    mode = StatisticsMode(passes=2, top_k_max=4)
    state = FitState(
        dict(zip(("train", "heldout"), _split_stats(LAYOUT, sources=candidates))),
        pass_index=2,
        candidates=candidates,
        probe=(probe_k, probe_v),
    )
    two = solve_candidates(state, mode, top_k=None, ridge_lambda=None, structure=Structure(), src_layers=8)
    assert [l.sources for l in two.layers] == [l.sources for l in one.layers]
    assert any(len(l.sources) > 1 for l in one.layers)
    for a, b in zip(one.layers, two.layers):
        assert (a.k_map.ridge_lambda, a.v_map.ridge_lambda) == (b.k_map.ridge_lambda, b.v_map.ridge_lambda)
        for x, y in ((a.k_map, b.k_map), (a.v_map, b.v_map)):
            torch.testing.assert_close(y.dense(len(b.sources), 6), x.dense(len(a.sources), 6), rtol=0, atol=1e-10)
            torch.testing.assert_close(y.bias, x.bias, rtol=0, atol=1e-10)
        assert b.r2_k == pytest.approx(a.r2_k, abs=1e-12)
    assert two.probe_r2_k.shape == (8, 2)  # pass 1's grid, every source layer: fp32 block products, rounded
    assert_close(two.probe_r2_k, one.probe_r2_k, terms=800)  # per block, not as one GEMM's sub-block
    assert "pass 2 kept source layers" in two.notes[-1]


def test_fp32_totals_error_is_the_float32_rounding_of_the_sums():
    """The same 200 batches merged into fp32 and fp64 totals: Chan merges keep the mean shift exact, so
    the fp32 totals are off by the rounding of ~200 fp32 additions, however large the offset."""
    gen = torch.Generator().manual_seed(3)
    wide, narrow = Moments(12, 4), Moments(12, 4, dtype=torch.float32)
    for batch in range(200):
        x = torch.randn(64, 12, generator=gen) * 3 + 1e3 + batch  # the mean drifts: every merge shifts it
        y = x[:, :4] * 0.5 + torch.randn(64, 4, generator=gen)
        wide.update(x, y)
        narrow.update(x, y)
    assert narrow.cxx.dtype == torch.float32 and narrow.mean_x.dtype == torch.float64
    for name in ("cxx", "cxy"):
        error = float((getattr(narrow, name).double() - getattr(wide, name)).abs().max())
        scale = float(getattr(wide, name).abs().max())
        assert 0 < error / scale < rtol(torch.float32, terms=200), name  # measured 3e-7 to 7e-7; bound 1.3e-5
    assert torch.equal(narrow.syy, wide.syy) and torch.equal(narrow.mean_x, wide.mean_x)


# ---- the fit on tiny models ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def family():
    """6 source layers, 2 target layers: each target's best 2 sources are at most 4 of the 6."""
    source = make_model("qwen2", num_hidden_layers=6, seed=11)
    target = make_model("qwen2", num_hidden_layers=2, num_key_value_heads=4, seed=12)
    return source, target, _ids(16, 16, 0), _ids(4, 16, 1)


def _options(**changes) -> FitOptions:
    options = FitOptions(top_k=2, stride=1, batch_size=4, statistics=ONE_PASS)
    return dataclasses.replace(options, **changes)


def _solve(family, options):
    """The fp64 solution and final statistics of a fit (what kvhub.fitting.fit.fit does before the Mapper)."""
    source, target, train, heldout = family
    layout = layout_for(source.config, target.config)
    state = accumulate_passes(
        source,
        target,
        fit_batches(train, heldout, options.batch_size),
        layout,
        mode=options.statistics,
        options=options,
        progress=None,
        job="test",
    )
    return solve_statistics(state, options.statistics, options=options, structure=Structure(), src_layers=6), state


@pytest.fixture
def live_stats(monkeypatch):
    """Records the bytes of all live KVStats after each is created: a list whose max is the peak."""
    live, totals = weakref.WeakSet(), []
    real_init = KVStats.__init__

    def tracking_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        live.add(self)
        totals.append(sum(stats.nbytes() for stats in live))

    monkeypatch.setattr(KVStats, "__init__", tracking_init)
    return totals


def test_two_pass_fit_equals_one_pass_fit_and_allocates_what_the_plan_says(family, live_stats):
    one = _solve(family, _options())[0]  # its statistics freed: only the two-pass fit's are live below
    one_peak = max(live_stats)
    live_stats.clear()
    mode = StatisticsMode(passes=2, top_k_max=2)  # no budget: every target's best 2
    two, state = _solve(family, _options(statistics=mode))
    two_peak = max(live_stats)
    assert all(set(l.sources) <= set(state.candidates) for l in one.layers)  # the precondition
    assert len(state.candidates) < 6
    assert [l.sources for l in two.layers] == [l.sources for l in one.layers]
    for a, b in zip(one.layers, two.layers):
        for x, y in ((a.k_map, b.k_map), (a.v_map, b.v_map)):
            assert x.ridge_lambda == y.ridge_lambda
            torch.testing.assert_close(y.dense(2, 32), x.dense(2, 32), rtol=0, atol=1e-10)
            torch.testing.assert_close(y.bias, x.bias, rtol=0, atol=1e-10)

    source, target, train, heldout = family
    shapes = [ModelShape.from_config(m.config.to_dict()) for m in (source, target)]
    workload = Workload(samples=16, heldout=4, seq_len=16, stride=1, batch_size=4, k=2, dtype="float32")
    assert one_peak == plan_fit(*shapes, workload, BIG, statistics=ONE_PASS).memory["statistics"]
    planned = plan_fit(*shapes, workload, BIG, statistics=dataclasses.replace(mode, candidates=len(state.candidates)))
    assert (
        two_peak
        == planned.memory["statistics"]
        == max(planned.memory["statistics_pass1"], planned.memory["statistics_pass2"])
    )
    assert two_peak < one_peak  # pass 1 was dropped before pass 2 allocated (else the sum)


def test_a_candidate_budget_keeps_the_best_of_every_target_first(family, live_stats):
    mode = StatisticsMode(passes=2, candidates=3, top_k_max=2, dtype="float32")
    solution, state = _solve(family, _options(statistics=mode))
    assert len(state.candidates) == 3 and state.stats["train"].k.cxx.dtype == torch.float32
    probe_k, probe_v = state.probe
    for layer in solution.layers:  # every target's best probe layer made it, and the maps read candidates only
        assert int(((probe_k + probe_v)[:, layer.target]).argmax()) in state.candidates
        assert set(layer.sources) <= set(state.candidates) and len(layer.sources) == 2
    source, target, _, _ = family
    shapes = [ModelShape.from_config(m.config.to_dict()) for m in (source, target)]
    workload = Workload(samples=16, heldout=4, seq_len=16, stride=1, batch_size=4, k=2, dtype="float32")
    assert max(live_stats) == plan_fit(*shapes, workload, BIG, statistics=mode).memory["statistics"]


def test_fit_takes_the_plans_mode(family, monkeypatch):
    """With the memory free between the two-pass and the one-pass peaks, 'auto' fits in two passes,
    with the candidates the plan chose; the plan and the fit agree because the fit asks the plan."""
    source, target, train, heldout = family
    shapes = [ModelShape.from_config(m.config.to_dict()) for m in (source, target)]
    workload = Workload(samples=16, heldout=4, seq_len=16, stride=1, batch_size=4, k=2, dtype="float32")
    one32 = plan_fit(*shapes, workload, BIG, statistics=StatisticsMode(dtype="float32"))
    two = plan_fit(
        *shapes, workload, BIG, statistics=StatisticsMode(passes=2, dtype="float32", candidates=2, top_k_max=2)
    )
    free = (two.memory["peak"] + one32.memory["peak"]) // 2
    loaded = sum(p.numel() * p.element_size() for m in (source, target) for p in m.parameters())
    monkeypatch.setattr(devices, "free_memory", lambda device: free - loaded)  # the models are loaded already
    expected = plan_fit(*shapes, workload, dataclasses.replace(planning.device_profile("cpu"), memory=free)).statistics
    assert expected.passes == 2 and 2 <= expected.candidates < 6
    mapper = fit(source, target, train, heldout, source_id="a", target_id="b", options=_options(statistics="auto"))
    assert mapper.metadata["fit"]["statistics"] == dataclasses.asdict(expected)
    assert any(note.startswith("two-pass statistics (float") for note in mapper.metadata["notes"])
    assert len(mapper.metadata["probe_r2"]["k"]) == 6  # pass 1's grid: every source layer
    monkeypatch.setattr(devices, "free_memory", lambda device: 10**12)
    roomy = fit(source, target, train, heldout, source_id="a", target_id="b", options=_options(statistics="auto"))
    assert roomy.metadata["fit"]["statistics"] == dataclasses.asdict(ONE_PASS)


class Killed(Exception):
    pass


def _kill_at(label: str, batch: int):
    """A progress callback that raises when ``label``'s ``batch`` (1-based) is about to be merged."""
    seen = []

    def progress(description, done, total):
        seen.append(description)
        if description.startswith(f"{label}: ") and f"batch {batch}/" in description:
            raise Killed

    return progress, seen


@pytest.mark.parametrize("label,batch", [("capture pass 1", 4), ("capture pass 2", 3)])
def test_killed_two_pass_fit_resumes_within_its_pass_to_the_same_mapper(family, tmp_path, label, batch):
    source, target, train, heldout = family
    mode = StatisticsMode(passes=2, candidates=3, top_k_max=2)
    clean = fit(source, target, train, heldout, source_id="a", target_id="b", options=_options(statistics=mode))
    options = _options(statistics=mode, checkpoint=tmp_path / "ckpt.safetensors", checkpoint_every=2)
    progress, _ = _kill_at(label, batch)
    with pytest.raises(Killed):
        fit(source, target, train, heldout, source_id="a", target_id="b", options=options, progress=progress)
    progress, seen = _kill_at("never", 0)
    resumed = fit(source, target, train, heldout, source_id="a", target_id="b", options=options, progress=progress)
    first = seen[0]
    done = 2 * ((batch - 1) // 2)  # the last checkpoint before the kill, every 2 batches
    assert first.startswith(f"{label}: ") and f"batch {done + 1}/" in first, seen[:3]
    if label == "capture pass 2":
        assert not any(line.startswith("capture pass 1") for line in seen)  # pass 1 was never run again
    assert sorted(resumed.tensors) == sorted(clean.tensors)
    for name, tensor in clean.tensors.items():  # the same batches merged in the same order: the same bits
        assert torch.equal(resumed.tensors[name], tensor), name
    assert resumed.layers == clean.layers


def test_a_checkpoint_of_another_mode_is_not_resumed(family, tmp_path):
    source, target, train, heldout = family
    checkpoint = tmp_path / "ckpt.safetensors"
    progress, _ = _kill_at("capture pass 2", 2)
    two = StatisticsMode(passes=2, candidates=3, top_k_max=2)
    with pytest.raises(Killed):
        fit(
            source,
            target,
            train,
            heldout,
            source_id="a",
            target_id="b",
            progress=progress,
            options=_options(statistics=two, checkpoint=checkpoint, checkpoint_every=1),
        )
    progress, seen = _kill_at("never", 0)
    fit(
        source,
        target,
        train,
        heldout,
        source_id="a",
        target_id="b",
        progress=progress,
        options=_options(statistics="one-pass", checkpoint=checkpoint),
    )
    assert seen[0].startswith("capture: train batch 1/")  # started over, in one pass
    progress, seen = _kill_at("never", 0)
    with pytest.raises(Killed):  # "auto" resumes the checkpoint's mode, whatever the plan says now
        fit(
            source,
            target,
            train,
            heldout,
            source_id="a",
            target_id="b",
            progress=_kill_at("capture pass 2", 2)[0],
            options=_options(statistics=two, checkpoint=checkpoint, checkpoint_every=1),
        )
    fit(
        source,
        target,
        train,
        heldout,
        source_id="a",
        target_id="b",
        progress=progress,
        options=_options(statistics="auto", checkpoint=checkpoint, checkpoint_every=1),
    )
    assert seen[0].startswith("capture pass 2: train batch 2/")


def test_two_pass_options_are_checked():
    with pytest.raises(ConfigError, match="cannot solve k up to 4"):
        StatisticsMode(passes=2, candidates=3, top_k_max=4)
    with pytest.raises(ConfigError, match="belong to two-pass"):
        StatisticsMode(passes=1, candidates=3)
    with pytest.raises(ConfigError, match="float64 or float32"):
        StatisticsMode(dtype="bfloat16")
    with pytest.raises(ConfigError, match="more than the 2 source layers"):
        StatisticsMode(passes=2, top_k_max=2).depth(3, (1, 2, 4), 6)
    assert StatisticsMode(passes=2, candidates=5).depth(None, (1, 2, 3, 4, 6, 8), 6) == 4


def test_fit_options_refuse_candidates_without_two_passes_and_an_unknown_mode():
    """The options themselves refuse, so a fit never starts with them."""
    for statistics in ("one-pass", StatisticsMode(passes=2)):
        with pytest.raises(ConfigError, match="--candidates sets what a two-pass fit"):
            _options(statistics=statistics, candidates=2)
    # raised to Python: the keyword first, then kvhub fit's flag (U3-12)
    with pytest.raises(
        ConfigError, match=re.escape("statistics='three-pass' (kvhub fit --stats): use one of auto, one-pass, two-pass")
    ):
        _options(statistics="three-pass")
