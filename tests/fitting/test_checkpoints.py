"""Damaged fit checkpoints (kvhub.fitting.checkpoint): a single-process fit warns in one line naming the file
and what is wrong, then starts over to the mapper of an uninterrupted fit; the ranks of a distributed fit
fall back to their previous generation (or start over) when their latest does not read; and the ranks of
``kvhub fit --distributed`` die with their launcher."""

import dataclasses
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvhub.core.stats import KVStats, Layout
from kvhub.fitting import checkpoint as checkpoints
from kvhub.fitting.checkpoint import FitState
from kvhub.fitting.fit import fit
from kvhub.fitting.options import FitOptions
from kvhub.fitting.modes import ONE_PASS, StatisticsMode
from tests.fixtures_fit import run_two_ranks, tiny_fit_args
from tests.tinymodels import make_model

TWO_PASS = StatisticsMode(passes=2, candidates=2, top_k_max=1)
BATCHES = 8  # 6 train + 2 held-out batches of 2 sequences


class Killed(Exception):
    pass


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny GEMMs: one thread is ten times faster than two threads contending on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def family():
    source = make_model("qwen2", num_hidden_layers=3, seed=2)
    target = make_model("qwen2", num_hidden_layers=2, seed=3)
    ids = torch.randint(0, 128, (16, 12), generator=torch.Generator().manual_seed(0))
    return source, target, ids[:12], ids[12:]


def _options(mode: StatisticsMode, **changes) -> FitOptions:
    return dataclasses.replace(
        FitOptions(top_k=1, ridge_lambda=0.01, stride=1, batch_size=2, statistics=mode, checkpoint_every=1), **changes
    )


def _fit(family, mode, checkpoint=None, progress=None):
    return fit(
        *family, source_id="src", target_id="dst", options=_options(mode, checkpoint=checkpoint), progress=progress
    )


@pytest.fixture(scope="module")
def clean(family):
    """The uninterrupted fit in each mode: what a fit that starts over must give, bit for bit."""
    return {mode: _fit(family, mode) for mode in (ONE_PASS, TWO_PASS)}


def _interrupted(family, mode: StatisticsMode, path: Path) -> None:
    """The checkpoint a fit killed after 3 batches (of pass 2 in two passes) leaves at ``path``."""
    label = "capture: " if mode.passes == 1 else "capture pass 2: "

    def kill(description, completed, total):
        if description.startswith(label) and "batch 4/" in description:
            raise Killed

    with pytest.raises(Killed):
        _fit(family, mode, path, kill)
    assert path.is_file()


@pytest.fixture(scope="module")
def interrupted(family, tmp_path_factory):
    """The bytes of :func:`_interrupted`'s checkpoint in each mode."""
    out = {}
    for mode in (ONE_PASS, TWO_PASS):
        path = tmp_path_factory.mktemp("interrupted") / "ckpt.safetensors"
        _interrupted(family, mode, path)
        out[mode] = path.read_bytes()
    return out


# ---- ways to damage a checkpoint -----------------------------------------------------------------
def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garbage(path: Path) -> None:
    path.write_bytes(random.Random(0).randbytes(4096))


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _rewrite(path: Path, *, header=None, tensors=None) -> None:
    """Write the checkpoint again with ``header(dict)`` and ``tensors(dict)`` applied (each changes in place)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
        state = {key: handle.get_tensor(key) for key in handle.keys()}
    for change, target in ((header, metadata), (tensors, state)):
        if change is not None:
            change(target)
    save_file(state, str(path), metadata=metadata)


def _header(key: str, value: str):
    return lambda path: _rewrite(path, header=lambda h: h.update({key: value}))


def _tensor(key: str, change):
    """Replace tensor ``key`` by ``change(tensor)`` (None: drop it)."""

    def apply(state):
        value = change(state.pop(key))
        if value is not None:
            state[key] = value

    return lambda path: _rewrite(path, tensors=apply)


def _nan_at_first(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.clone()
    tensor.view(-1)[0] = float("nan")
    return tensor


DAMAGES = [  # id, mode, damage, what the warning says
    ("truncated", ONE_PASS, _cut, "does not read as safetensors"),
    ("another-fit", ONE_PASS, _header("job", "another fit's identity"), "belongs to another fit"),  # R20: once
    ("garbage", ONE_PASS, _garbage, "does not read as safetensors"),
    ("empty", ONE_PASS, _empty, "does not read as safetensors"),
    ("directory", ONE_PASS, _directory, "is a directory"),
    ("pass-word", ONE_PASS, _header("pass", "one"), "has pass 'one', not an integer"),
    ("pass-2-in-one-pass", ONE_PASS, _header("pass", "2"), "has pass 2, outside 1..1"),
    ("batches-done-negative", ONE_PASS, _header("batches_done", "-5"), "has batches_done -5, outside 0..8"),
    ("batches-done-too-many", ONE_PASS, _header("batches_done", "100000"), "has batches_done 100000, outside 0..8"),
    ("batches-done-word", ONE_PASS, _header("batches_done", "one"), "has batches_done 'one', not an integer"),
    ("statistics-unparsable", ONE_PASS, _header("statistics", "{one pass"), "has unreadable statistics"),
    ("statistics-wrong-fields", ONE_PASS, _header("statistics", '{"passes": 3}'), "has unreadable statistics"),
    ("nan-in-gram", ONE_PASS, _tensor("train.k.cxx", _nan_at_first), "has non-finite values in train.k.cxx"),
    (
        "inf-in-mean",
        ONE_PASS,
        _tensor("heldout.v.mean_y", lambda t: t * float("inf")),
        "has non-finite values in heldout.v.mean_y",
    ),
    ("wrong-shape-cross", ONE_PASS, _tensor("train.v.cxy", lambda t: t[:, :-1].contiguous()), "has tensor train.v.cxy"),
    ("wrong-dtype-gram", ONE_PASS, _tensor("train.k.cxx", lambda t: t.float()), "has tensor train.k.cxx"),
    ("missing-tensor", ONE_PASS, _tensor("heldout.k.syy", lambda t: None), "lacks tensor heldout.k.syy"),
    ("other-layout", ONE_PASS, _tensor("train.layout", lambda t: t.flip(0)), "has statistics of layout"),
    ("negative-row-count", ONE_PASS, _tensor("train.k.n", lambda t: -t), "has train.k.n"),
    ("candidates-out-of-range", TWO_PASS, _header("candidates", "0,7"), "has candidates '0,7'"),
    ("candidates-unsorted", TWO_PASS, _header("candidates", "2,0"), "has candidates '2,0'"),
    ("candidates-word", TWO_PASS, _header("candidates", "one"), "has candidates 'one'"),
    (
        "candidates-missing",
        TWO_PASS,
        lambda p: _rewrite(p, header=lambda h: h.pop("candidates")),
        "has candidates None",
    ),
    ("probe-missing", TWO_PASS, _tensor("probe.v", lambda t: None), "lacks tensor probe.v"),
    ("truncated-two-pass", TWO_PASS, _cut, "does not read as safetensors"),
]


@pytest.mark.parametrize("mode,damage,says", [row[1:] for row in DAMAGES], ids=[row[0] for row in DAMAGES])
def test_a_damaged_checkpoint_warns_and_the_fit_starts_over(
    family, clean, interrupted, tmp_path, caplog, mode, damage, says
):
    path = tmp_path / "ckpt.safetensors"
    path.write_bytes(interrupted[mode])
    damage(path)
    seen = []
    with caplog.at_level(logging.WARNING, logger="kvhub.fitting"):
        mapper = _fit(family, mode, path, lambda description, *_: seen.append(description))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and str(path) in r.getMessage()]
    assert len(warnings) == 1 and says in warnings[0] and "starting over" in warnings[0], warnings
    assert "\n" not in warnings[0]
    assert seen[0].startswith(("capture: train batch 1/", "capture pass 1: train batch 1/")), seen[:2]
    for name, tensor in clean[mode].tensors.items():  # the statistics of every batch, once: the same bits
        assert torch.equal(mapper.tensors[name], tensor), name
    assert mapper.metadata["metrics"] == clean[mode].metadata["metrics"]
    assert path.is_dir() if damage is _directory else path.is_file()  # a directory is left alone


def test_an_intact_checkpoint_still_resumes(family, clean, interrupted, tmp_path, caplog):
    """The checks pass what a fit wrote: both modes resume after the checkpointed batches, without a warning."""
    for mode, first in ((ONE_PASS, "capture: train batch 4/"), (TWO_PASS, "capture pass 2: train batch 4/")):
        path = tmp_path / f"{mode.passes}.safetensors"
        path.write_bytes(interrupted[mode])
        seen = []
        with caplog.at_level(logging.WARNING, logger="kvhub.fitting"):
            mapper = _fit(family, mode, path, lambda description, *_: seen.append(description))  # noqa: B023 - used in this iteration
        assert seen[0].startswith(first), seen[:2]
        assert all(torch.equal(mapper.tensors[n], t) for n, t in clean[mode].tensors.items())
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# the CLI fits that a test kills and resumes: one-layer maps, one sequence a batch, no store row
_CHECKPOINTED = dict(samples=8, seq_len=16, k=1, lambda_="0.01", batch_size=1, no_register=True)


def test_kvhub_fit_runs_past_a_directory_at_the_checkpoint_path(
    tiny_model_dirs, tmp_path, monkeypatch, caplog, text_corpus
):
    """Through the CLI, with and without --restart (which deletes the checkpoint): a warning and a mapper,
    the directory left alone."""
    from click.testing import CliRunner

    import kvhub.fitting.fit as fit_module
    from kvhub.cli.main import main

    monkeypatch.setenv("KVHUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KVHUB_HOME", str(tmp_path / "home"))
    src, dst = tiny_model_dirs
    args = tiny_fit_args(
        src, dst, calib=text_corpus, **_CHECKPOINTED, db=f"sqlite:///{tmp_path / 'store.db'}", json=True
    )
    runner = CliRunner()
    real, calls = fit_module._accumulate_batch, []

    def dies_after_six(*a, **k):
        calls.append(1)
        if len(calls) > 6:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(fit_module, "_accumulate_batch", dies_after_six)
    assert runner.invoke(main, args + ["--out", str(tmp_path / "killed")]).exit_code != 0
    monkeypatch.setattr(fit_module, "_accumulate_batch", real)
    (path,) = (tmp_path / "cache" / "checkpoints").glob("*.safetensors")
    _directory(path)
    summaries = []
    for extra, out in (([], "first"), (["--restart"], "second")):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvhub.fitting"):
            result = runner.invoke(main, args + ["--out", str(tmp_path / out)] + extra)
        assert result.exit_code == 0, result.output
        assert any(f"checkpoint {path} is a directory" in r.getMessage() for r in caplog.records)
        summaries.append(json.loads(result.stdout)["metrics"])
        assert path.is_dir()
    assert summaries[0] == summaries[1]


# ---- distributed: each rank's generations ----------------------------------------------------------
LAYOUT = Layout(1, 2, 1, 2)


def _generation(path: Path, job: str, steps: int) -> None:
    """A checkpoint of ``steps`` steps whose train statistics hold 10 rows a step (so the row count says
    which generation was loaded)."""
    stats = {"train": KVStats(LAYOUT), "heldout": KVStats(LAYOUT)}
    stats["train"].update(*[[torch.randn(steps * 10, 2, generator=torch.Generator().manual_seed(i))] for i in range(4)])
    checkpoints.save(path, job, ONE_PASS, FitState(stats, batches_done=steps))


def _resume_main(rank: int, port: int, checkpoint: Path) -> None:
    from kvhub.fitting.distributed import Group, _resume

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import traceback

    import torch.distributed as dist

    try:
        dist.init_process_group("gloo")
        state = _resume(Group(rank, 2, torch.device("cpu")), checkpoint, f"job{rank}", ONE_PASS, layout=LAYOUT, steps=4)
        resumed = None if state is None else [state.batches_done, state.stats["train"].n]
        (checkpoint.parent / f"resumed.rank{rank}.json").write_text(json.dumps(resumed))
    except BaseException:  # noqa: BLE001 - the child reports every failure to the test
        (checkpoint.parent / f"error.rank{rank}.txt").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def _nan_gram(path: Path) -> None:
    _tensor("train.k.cxx", _nan_at_first)(path)


RANK_DAMAGES = [  # id, {(rank, generation): damage}, (batches_done, train rows) every rank resumes with (None: over)
    ("intact", {}, [3, 30]),
    ("rank1-latest-truncated", {(1, 0): _cut}, [2, 20]),
    ("rank0-latest-garbage", {(0, 0): _garbage}, [2, 20]),
    ("rank1-latest-empty", {(1, 0): _empty}, [2, 20]),
    ("rank0-latest-directory", {(0, 0): _directory}, [2, 20]),
    ("rank1-latest-batches-done-word", {(1, 0): _header("batches_done", "one")}, [2, 20]),
    ("rank1-latest-nan-in-gram", {(1, 0): _nan_gram}, [2, 20]),  # the header reads: found on loading
    ("rank1-both-generations-truncated", {(1, 0): _cut, (1, 1): _cut}, None),
    ("rank0-latest-and-rank1-previous", {(0, 0): _cut, (1, 1): _garbage}, None),
]


@pytest.mark.parametrize("damages,expected", [row[1:] for row in RANK_DAMAGES], ids=[row[0] for row in RANK_DAMAGES])
def test_a_rank_whose_latest_generation_does_not_read_falls_back(tmp_path, damages, expected):
    """Each rank holds generations of 3 (latest) and 2 steps; the ranks agree on the newest one every rank reads."""
    from kvhub.fitting.distributed import Group, _rank_paths

    checkpoint = tmp_path / "checkpoint.safetensors"
    for rank in range(2):
        for generation, (path, steps) in enumerate(
            zip(_rank_paths(Group(rank, 2, torch.device("cpu")), checkpoint), (3, 2))
        ):
            _generation(path, f"job{rank}", steps)
            if (rank, generation) in damages:
                damages[rank, generation](path)
    codes = run_two_ranks(_resume_main, checkpoint)
    errors = "\n".join(f.read_text() for f in tmp_path.glob("error.rank*.txt"))
    assert codes == [0, 0], errors
    assert [json.loads((tmp_path / f"resumed.rank{r}.json").read_text()) for r in range(2)] == [expected] * 2


# ---- kvhub fit --distributed: the ranks die with the launcher --------------------------------------
def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow  # three Python processes importing torch, then a tiny fit: about a minute on 2 busy cores
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("killed", ["launcher", "launcher-and-torchrun"])
def test_ranks_of_kvhub_fit_distributed_die_with_their_launcher(tiny_model_dirs, tmp_path, text_corpus, killed):
    """SIGKILL of ``kvhub fit --distributed 2`` (and of its torchrun) mid-fit: the ranks are gone within
    seconds, and nothing was exported."""
    src, dst = tiny_model_dirs
    env = {
        **os.environ,
        "KVHUB_CACHE": str(tmp_path / "cache"),
        "KVHUB_HOME": str(tmp_path / "home"),
        "OMP_NUM_THREADS": "1",
    }
    out = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "kvhub",
        *tiny_fit_args(
            src, dst, calib=text_corpus, **(_CHECKPOINTED | {"samples": 240}), out=out, ignore_plan=True, distributed=2
        ),
    ]
    stderr = tmp_path / "stderr.txt"
    with stderr.open("wb") as sink:
        launcher = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=sink, start_new_session=True)
    ranks = []
    try:
        deadline = time.monotonic() + 240
        while not list((tmp_path / "cache").glob("checkpoints/*.rank1-of-2.safetensors")):  # both ranks mid-fit
            assert launcher.poll() is None and time.monotonic() < deadline, stderr.read_text()[-3000:]
            time.sleep(0.05)
        (torchrun,) = _children(launcher.pid)
        ranks = _children(torchrun)
        assert len(ranks) == 2
        launcher.kill()
        if killed == "launcher-and-torchrun":
            os.kill(torchrun, signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in [torchrun, *ranks]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in [torchrun, *ranks] if _alive(pid)]
        assert not out.exists()
    finally:
        for pid in ranks:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()


def test_a_rank_whose_launcher_is_gone_stops_before_it_joins(tmp_path):
    """The window before a rank sets its parent-death signal: $KVHUB_FIT_LAUNCHER names a process that is
    not its grandparent, so it exits at once with a message."""
    env = {**os.environ, "KVHUB_FIT_LAUNCHER": "1" if os.getppid() != 1 else "2"}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from kvhub.fitting.distributed import die_with_launcher; die_with_launcher(); print('joined')",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if not sys.platform.startswith("linux"):
        assert done.returncode == 0 and "joined" in done.stdout
        return
    assert done.returncode == 1 and "joined" not in done.stdout
    assert "kvhub fit --distributed (pid" in done.stderr and "this rank stops" in done.stderr
