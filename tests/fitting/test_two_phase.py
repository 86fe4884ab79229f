"""Two-phase capture (kvhub.fitting.phases, kvhub.fitting.spool): the source alone fills a spool, then the
target alone reads it back.  The statistics and the mapper equal the one-phase fit's, one model is loaded at a
time, a fit stopped (Ctrl-C or kill -9) in either phase resumes to the same mapper, an interrupted spool is
never read as complete, the spool goes when the fit ends, and nothing under it is followed through a link."""

import dataclasses
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from kvhub.errors import FitError, FitInterrupted
from kvhub.fitting import spool as spools
from kvhub.fitting.fit import accumulate_passes, fit, fit_batches
from kvhub.fitting.modes import ONE_PASS, StatisticsMode
from kvhub.fitting.options import FitOptions
from kvhub.fitting.phases import LiveSource, fill_spool, spooled
from kvhub.fitting.resident import ModelHandle
from kvhub.fitting.spool import Spool
from tests.fixtures_fit import assert_same_statistics, live_and_spooled
from tests.tinymodels import make_model

TWO_PASS = StatisticsMode(passes=2, candidates=2, top_k_max=1)
BATCHES = 8  # 6 train + 2 held-out batches of 2 sequences


class Stop(Exception):
    pass


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVHUB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def family():
    source = make_model("qwen2", num_hidden_layers=3, seed=2)
    target = make_model("qwen2", num_hidden_layers=2, seed=3)
    ids = torch.randint(0, 128, (16, 12), generator=torch.Generator().manual_seed(0))
    return source, target, ids[:12], ids[12:]


def _options(mode=ONE_PASS, **changes) -> FitOptions:
    base = FitOptions(top_k=1, ridge_lambda=0.01, stride=1, batch_size=2, statistics=mode, checkpoint_every=1)
    return dataclasses.replace(base, **changes)


def _fit(source, target, train, heldout, *, progress=None, **changes):
    return fit(
        source, target, train, heldout, source_id="src", target_id="dst", options=_options(**changes), progress=progress
    )


def _handles(family):
    """(source, target) handles over the family's models, and the log of which is loaded when each loads."""
    source, target, *_ = family
    events = []
    handles = {}

    def loader(name, model):
        def load():
            events.append((name, sorted(other for other, h in handles.items() if h.is_loaded)))
            return model

        return load

    for name, model in (("source", source), ("target", target)):
        handles[name] = ModelHandle(
            loader(name, model), config=model.config, dtype=model.dtype, device="cpu", name=name
        )
    return handles["source"], handles["target"], events


def _same_mapper(a, b):
    assert a.tensors.keys() == b.tensors.keys()
    for name in a.tensors:
        assert torch.equal(a.tensors[name], b.tensors[name]), name
    assert a.metadata["layers"] == b.metadata["layers"]


@pytest.fixture(scope="module")
def one_phase(family):
    return {mode: _fit(*family, statistics=mode, capture="one-phase") for mode in (ONE_PASS, TWO_PASS)}


# ---- the same numbers ------------------------------------------------------------------------------
def test_two_phase_statistics_equal_one_phase_statistics(family, cache):
    source, target, train, heldout = family
    options = _options()
    layout, batches, live, spool = live_and_spooled(source, target, train, heldout, options, job="j")
    read = accumulate_passes(
        spooled(source, spool), target, batches, layout, mode=ONE_PASS, options=options, progress=None, job="j"
    )
    assert_same_statistics(live, read, atol=1e-10)
    assert live.stats["train"].n == 12 * 12 and live.stats["heldout"].n == 4 * 12


@pytest.mark.parametrize("mode", [ONE_PASS, TWO_PASS], ids=["one-pass", "two-pass"])
def test_two_phase_fit_gives_the_one_phase_mapper_with_one_model_loaded_at_a_time(family, one_phase, mode, cache):
    source, target, events = _handles(family)
    mapper = _fit(source, target, *family[2:], statistics=mode, capture="two-phase")
    _same_mapper(mapper, one_phase[mode])
    assert events == [("source", []), ("target", [])]  # the source was let go before the target loaded
    assert (source.loads, target.loads) == (1, 1) and not source.is_loaded
    assert mapper.metadata["fit"]["capture"] == "two-phase"
    assert one_phase[mode].metadata["fit"]["capture"] == "one-phase"
    assert not list((cache / "spool").iterdir())  # the fit removed its spool


def test_attention_weighting_comes_from_the_target_in_phase_2(family, cache):
    _same_mapper(_fit(*family, capture="two-phase", weighting="attention"), _fit(*family, weighting="attention"))


def test_a_mlp_fit_takes_its_row_samples_from_the_spool(family, cache):
    changes = {"map_kind": "mlp", "mlp_tokens": 16, "mlp_epochs": 2, "mlp_width": 8}
    _same_mapper(_fit(*family, capture="two-phase", **changes), _fit(*family, capture="one-phase", **changes))


# ---- stopping and resuming -------------------------------------------------------------------------
def _stop_at(label, batch):
    def progress(description, completed, total):
        if description.startswith(label) and f"batch {batch}/" in description:
            raise KeyboardInterrupt

    return progress


def test_ctrl_c_in_phase_1_keeps_the_spool_and_a_rerun_captures_only_the_rest(family, one_phase, cache):
    with pytest.raises(FitInterrupted, match=r"phase 1 .* batch 4/8; the spool keeps 3 batches"):
        _fit(*family, capture="two-phase", progress=_stop_at("phase 1", 4))
    (directory,) = (cache / "spool").iterdir()
    assert sorted(p.name for p in directory.iterdir()) == [spools.entry_name(i) for i in range(3)]  # no complete.json
    captured = []
    source, target, _ = _handles(family)
    real = LiveSource.capture
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LiveSource, "capture", lambda self, i, ids, layers=None: captured.append(i) or real(self, i, ids))
        mapper = _fit(source, target, *family[2:], capture="two-phase")
    assert captured == [3, 4, 5, 6, 7]
    _same_mapper(mapper, one_phase[ONE_PASS])


def test_ctrl_c_in_phase_2_resumes_without_the_source(family, one_phase, cache, tmp_path):
    checkpoint = tmp_path / "ckpt.safetensors"
    with pytest.raises(FitInterrupted):
        _fit(
            *family,
            capture="two-phase",
            checkpoint=checkpoint,
            progress=_stop_at("capture pass 2", 2),
            statistics=TWO_PASS,
        )
    assert checkpoint.is_file()
    source, target, events = _handles(family)
    mapper = _fit(source, target, *family[2:], capture="two-phase", checkpoint=checkpoint, statistics=TWO_PASS)
    assert source.loads == 0 and events == [("target", [])]  # the spool was complete: the source never loaded
    _same_mapper(mapper, one_phase[TWO_PASS])


@pytest.mark.parametrize("where", ["phase 1 (source): train batch 3/", "capture: train batch 5/"])
def test_kill_9_in_either_phase_then_a_rerun_gives_the_same_mapper(family, one_phase, cache, tmp_path, where):
    """A process killed with SIGKILL mid-phase (no handler runs) leaves a spool and a checkpoint a rerun resumes."""
    checkpoint = tmp_path / "ckpt.safetensors"
    script = f"""
import os, signal, torch
from tests.fitting.test_two_phase import _fit
from tests.fixtures_fit import assert_same_statistics, live_and_spooled
from tests.tinymodels import make_model
source = make_model("qwen2", num_hidden_layers=3, seed=2)
target = make_model("qwen2", num_hidden_layers=2, seed=3)
ids = torch.randint(0, 128, (16, 12), generator=torch.Generator().manual_seed(0))
def progress(description, completed, total):
    if description.startswith({where!r}):
        os.kill(os.getpid(), signal.SIGKILL)
_fit(source, target, ids[:12], ids[12:], capture="two-phase", checkpoint={str(checkpoint)!r}, progress=progress)
"""
    env = {**os.environ, "KVHUB_CACHE": str(cache)}
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=os.getcwd(), capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    (directory,) = (cache / "spool").iterdir()
    assert (directory / spools.COMPLETE).exists() == where.startswith("capture")
    mapper = _fit(*family, capture="two-phase", checkpoint=checkpoint)
    _same_mapper(mapper, one_phase[ONE_PASS])
    assert not directory.exists()


# ---- what is read ----------------------------------------------------------------------------------
def test_a_damaged_entry_stops_phase_2_and_a_rerun_recaptures_it(family, one_phase, cache):
    source, target, train, heldout = family
    batches = fit_batches(train, heldout, 2)
    spool = Spool.for_job("k" * 24, batches=len(batches), layers=3)
    fill_spool(source, batches, spool, stride=1, skip_first=0)
    entry = spool.directory / spools.entry_name(5)
    entry.write_bytes(entry.read_bytes()[:-40])
    with pytest.raises(FitError, match="batch-00005.* rerun the fit to capture that batch again"):
        spooled(source, spool).capture(5, batches[5][1])
    assert not spool.complete() and not entry.exists()
    assert spool.missing() == [5]


def test_an_entry_of_another_job_or_a_link_is_not_taken(family, cache, tmp_path):
    source, _, train, heldout = family
    batches = fit_batches(train, heldout, 2)
    theirs = Spool.for_job("a" * 24, batches=len(batches), layers=3)
    fill_spool(source, batches, theirs, stride=1, skip_first=0)
    ours = Spool.for_job("b" * 24, batches=len(batches), layers=3)
    ours.directory.mkdir(parents=True)
    os.link(theirs.directory / spools.entry_name(0), ours.directory / spools.entry_name(0))  # another job's header
    (ours.directory / spools.entry_name(1)).symlink_to(theirs.directory / spools.entry_name(1))
    assert ours.missing() == list(range(BATCHES))
    assert (theirs.directory / spools.entry_name(1)).is_file()  # the link's target is untouched
    link = spools.spool_root() / ("c" * 24)
    link.symlink_to(tmp_path)
    with pytest.raises(FitError, match="is a symbolic link"):
        Spool.for_job("c" * 24, batches=1, layers=3).missing()


def test_sweep_removes_stale_spools_and_never_follows_links(family, cache, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    root = spools.spool_root()
    stale, fresh = root / "stale", root / "fresh"
    for directory in (stale, fresh):
        directory.mkdir(parents=True)
        (directory / spools.entry_name(0)).write_bytes(b"x")
    (stale / "link").symlink_to(victim)
    (root / "linked").symlink_to(victim)
    old = time.time() - 2 * spools.STALE_AFTER_S
    for path in (stale / spools.entry_name(0), stale / "link"):
        os.utime(path, (old, old), follow_symlinks=False)
    assert spools.sweep(dry_run=True) == [stale] and stale.exists()
    assert spools.sweep() == [stale]
    assert not stale.exists() and fresh.exists()
    assert (victim / "precious.txt").read_text() == "keep me"


# ---- by names: kvhub fit --capture -------------------------------------------------------------------
def test_kvhub_fit_two_phase_loads_the_target_after_the_source_and_gives_the_one_phase_mapper(
    tiny_model_dirs, text_corpus, tmp_path, cache
):
    from click.testing import CliRunner

    from kvhub.core.mapper import Mapper
    from kvhub.cli.main import main
    from kvhub.fitting.job import FitRequest, prepare
    from tests.fixtures_fit import tiny_fit_args

    src, dst = tiny_model_dirs
    job = prepare(
        FitRequest(
            str(src),
            str(dst),
            calib=str(text_corpus),
            samples=12,
            seq_len=24,
            dtype="float32",
            device="cpu",
            options=FitOptions(capture="two-phase"),
        )
    )
    assert isinstance(job.target, ModelHandle) and not job.target.is_loaded and not job.source.is_loaded
    assert job.options.capture == "two-phase"
    mappers = {}
    for capture in ("one-phase", "two-phase"):
        out = tmp_path / capture
        args = tiny_fit_args(src, dst, calib=text_corpus, capture=capture, out=out, no_register=True)
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        mappers[capture] = Mapper.load(out)
    _same_mapper(mappers["two-phase"], mappers["one-phase"])
    assert not list((cache / "spool").iterdir())


def test_kvhub_gc_removes_stale_spools_only(cache, tmp_path):
    import json

    from click.testing import CliRunner

    from kvhub.cli.main import main
    from kvhub.cli.options import open_db

    db = f"sqlite:///{tmp_path / 'store.db'}"
    open_db(db).close()
    stale = spools.spool_root() / "stale"
    stale.mkdir(parents=True)
    (stale / spools.entry_name(0)).write_bytes(b"12345")
    old = time.time() - 2 * spools.STALE_AFTER_S
    os.utime(stale / spools.entry_name(0), (old, old))
    (spools.spool_root() / "fresh").mkdir()
    dry = CliRunner().invoke(main, ["gc", "--dry-run", "--db", db, "--format", "json"])
    assert dry.exit_code == 0, dry.output
    assert json.loads(dry.stdout)["spools"] == [{"path": str(stale), "bytes": 5}] and stale.exists()
    done = CliRunner().invoke(main, ["gc", "--db", db])
    assert done.exit_code == 0 and "removed 1 stale fit spools" in done.output
    assert not stale.exists() and (spools.spool_root() / "fresh").exists()


def test_restart_removes_this_fits_spool(family, cache):
    from kvhub.fitting.phases import discard_spool
    from kvhub.fitting.prepared import as_prepared

    with pytest.raises(FitInterrupted):
        _fit(*family, capture="two-phase", progress=_stop_at("phase 1", 3))
    (directory,) = spools.spool_root().iterdir()
    job = as_prepared(*family, source_id="src", target_id="dst", options=_options(capture="two-phase"))
    discard_spool(job)
    assert not directory.exists()
