"""The distributed fit (kvhub.fitting.distributed) on 2 gloo processes equals the single-process fit, also
when a rank dies mid-capture and the job is started again from the per-rank checkpoints; in one pass and
in two (each rank probing its own target layers)."""

import dataclasses
import json
import os
import re
from pathlib import Path

import pytest
import torch

from kvhub.fitting.distributed import owned_layers
from kvhub.errors import ConfigError
from kvhub.fitting.checkpoint import FitState
from kvhub.fitting.fit import fit
from kvhub.fitting.options import FitOptions
from kvhub.fitting.modes import ONE_PASS, StatisticsMode
from kvhub.core.stats import KVStats, Layout
from tests.fixtures_fit import run_two_ranks, tiny_fit_args
from tests.tinymodels import make_model

DIE_AT_STEP = 2  # rank 1 dies when it starts this step, after the checkpoint of the steps before
STEP = re.compile(r"^(.*): step (\d+)/")


def _family():
    """A source and a target of different depth and KV geometry, and calibration ids (train, held-out)."""
    source = make_model("qwen2", num_hidden_layers=2, seed=4)
    target = make_model("qwen2", num_hidden_layers=3, num_key_value_heads=4, seed=5)
    ids = torch.randint(0, 128, (14, 16), generator=torch.Generator().manual_seed(0))
    return source, target, ids[:11], ids[11:]


def _options(**changes) -> FitOptions:
    # 6 + 2 batches: 4 steps on 2 ranks, the last rank-1 batch held-out; k and lambda chosen on held-out R^2
    return dataclasses.replace(FitOptions(stride=1, batch_size=2, checkpoint_every=1), **changes)


def _rank_main(rank: int, port: int, out: Path, die_at, family, options: FitOptions) -> None:
    """One rank, in a process forked from the test (so the tiny models and imports come for free); rank 1
    dies when it starts step ``die_at`` = (label, step) (None: never)."""
    import traceback

    from safetensors.torch import save_file

    from kvhub.fitting.distributed import fit_distributed, init_group

    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "KVHUB_DIST_TIMEOUT": "60",
        }
    )
    torch.set_num_threads(1)
    steps = []

    def progress(description, completed, total):
        step = STEP.match(description)
        if step:
            steps.append([step.group(1), int(step.group(2)) - 1])
            if rank == 1 and steps[-1] == die_at:
                os._exit(3)  # no cleanup, like a killed process

    try:
        group = init_group("cpu")
        source, target, train, heldout = family
        mapper = fit_distributed(
            source,
            target,
            train,
            heldout,
            group=group,
            source_id="src",
            target_id="dst",
            options=dataclasses.replace(options, checkpoint=out / "checkpoint.safetensors"),
            progress=progress,
        )
        (out / f"steps.rank{rank}.json").write_text(json.dumps(steps))
        if mapper is not None:
            save_file({k: v.contiguous() for k, v in mapper.tensors.items()}, str(out / "mapper.safetensors"))
            (out / "layers.json").write_text(json.dumps(mapper.layers))
            (out / "metadata.json").write_text(json.dumps(mapper.metadata))
    except BaseException:  # noqa: BLE001 - the child reports every failure to the test
        (out / f"error.rank{rank}.txt").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)  # skip the test process's exit handlers


def _run_ranks(out: Path, family, options: FitOptions, *, die_at=None) -> list[int]:
    codes = run_two_ranks(_rank_main, out, die_at, family, options, timeout=120)
    if die_at is None and codes != [0, 0]:
        raise AssertionError("\n".join(f.read_text() for f in out.glob("error.rank*.txt")) or f"exit codes {codes}")
    return codes


def _single(family, options: FitOptions):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks' thread count: the same GEMM kernels
    try:
        return fit(*family, source_id="src", target_id="dst", options=options)
    finally:
        torch.set_num_threads(threads)


def _assert_same_mapper(out: Path, single) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(out / "mapper.safetensors"))
    assert sorted(tensors) == sorted(single.tensors)
    for name, expected in single.tensors.items():
        torch.testing.assert_close(tensors[name].double(), expected.double(), rtol=0, atol=1e-10, msg=name)
    distributed_layers = json.loads((out / "layers.json").read_text())
    assert [(l["target"], l["sources"], l["lambda_k"], l["lambda_v"]) for l in distributed_layers] == [
        (l["target"], l["sources"], l["lambda_k"], l["lambda_v"]) for l in single.layers
    ]


def test_two_gloo_ranks_equal_one_process_also_after_a_rank_dies(tmp_path):
    family = _family()
    single = _single(family, _options())
    die_at = ["capture", DIE_AT_STEP]
    codes = _run_ranks(tmp_path, family, _options(), die_at=die_at)
    assert codes[1] == 3 and codes[0] != 0  # rank 0 fails on the lost peer instead of hanging
    assert not (tmp_path / "mapper.safetensors").exists()
    assert _run_ranks(tmp_path, family, _options()) == [0, 0]
    for rank in range(2):  # both resumed after the last step every rank had checkpointed
        assert json.loads((tmp_path / f"steps.rank{rank}.json").read_text()) == [
            ["capture", DIE_AT_STEP],
            ["capture", DIE_AT_STEP + 1],
        ]
    _assert_same_mapper(tmp_path, single)
    assert single.metadata["chosen_by"] == "held-out R^2"


def test_a_truncated_latest_rank_checkpoint_falls_back_to_the_previous_generation(tmp_path):
    """Rank 1's latest generation cut short (its previous one kept): both ranks resume one step earlier,
    from their previous generations, to the single-process mapper."""
    family = _family()
    codes = _run_ranks(tmp_path, family, _options(), die_at=["capture", DIE_AT_STEP])
    assert codes[1] == 3 and codes[0] != 0
    latest = tmp_path / "checkpoint.rank1-of-2.safetensors"
    assert (tmp_path / "checkpoint.rank1-of-2.prev.safetensors").is_file()
    latest.write_bytes(latest.read_bytes()[:100])
    assert _run_ranks(tmp_path, family, _options()) == [0, 0]
    for rank in range(2):
        assert json.loads((tmp_path / f"steps.rank{rank}.json").read_text()) == [
            ["capture", DIE_AT_STEP - 1],
            ["capture", DIE_AT_STEP],
            ["capture", DIE_AT_STEP + 1],
        ]
    _assert_same_mapper(tmp_path, _single(family, _options()))


def test_two_pass_on_two_ranks_equals_one_process_also_after_a_rank_dies_in_pass_two(tmp_path):
    """Each rank probes its own target layers and keeps their best source layer; the single process keeps
    every target's: the same layers per target, the same sums, the same mapper."""
    source = make_model("qwen2", num_hidden_layers=4, seed=6)
    target = make_model("qwen2", num_hidden_layers=3, num_key_value_heads=4, seed=7)
    ids = torch.randint(0, 128, (14, 16), generator=torch.Generator().manual_seed(1))
    family = (source, target, ids[:11], ids[11:])
    options = _options(top_k=1, statistics=StatisticsMode(passes=2, top_k_max=1))
    single = _single(family, options)
    codes = _run_ranks(tmp_path, family, options, die_at=["capture pass 2", 1])
    assert codes[1] == 3 and codes[0] != 0
    assert _run_ranks(tmp_path, family, options) == [0, 0]
    for rank in range(2):  # pass 1 was not run again; pass 2 resumed at its agreed step
        assert json.loads((tmp_path / f"steps.rank{rank}.json").read_text()) == [
            ["capture pass 2", 1],
            ["capture pass 2", 2],
            ["capture pass 2", 3],
        ]
    _assert_same_mapper(tmp_path, single)
    notes = json.loads((tmp_path / "metadata.json").read_text())["notes"]
    assert sum("two-pass statistics" in note for note in notes) == 2  # one per rank, each its own candidates
    probe = json.loads((tmp_path / "metadata.json").read_text())["probe_r2"]["k"]
    assert (len(probe), len(probe[0])) == (4, 3)  # pass 1's grids, assembled over the ranks' target layers
    assert all(len(l["sources"]) == 1 for l in single.layers)


def _resume_main(rank: int, port: int, checkpoint: Path, layout) -> None:
    from kvhub.fitting.distributed import Group, _resume

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import torch.distributed as dist

    dist.init_process_group("gloo")
    state = _resume(Group(rank, 2, torch.device("cpu")), checkpoint, f"job{rank}", ONE_PASS, layout=layout, steps=4)
    (checkpoint.parent / f"resumed.rank{rank}.json").write_text(
        json.dumps([state.batches_done, state.stats["train"].n])
    )
    os._exit(0)


def test_resume_takes_the_latest_generation_every_rank_has(tmp_path):
    """Rank 0 wrote step 3 and was killed before rank 1 did: both resume from step 2, rank 0 from its
    previous generation (the stats' row count tells which file was loaded)."""

    from kvhub.fitting import checkpoint as checkpoints
    from kvhub.fitting.distributed import Group, _rank_paths

    layout = Layout(1, 2, 1, 2)
    checkpoint = tmp_path / "checkpoint.safetensors"
    for rank, generations in ((0, (3, 2)), (1, (2, 1))):
        for path, steps in zip(_rank_paths(Group(rank, 2, torch.device("cpu")), checkpoint), generations):
            stats = {"train": KVStats(layout), "heldout": KVStats(layout)}
            stats["train"].update(
                [torch.randn(steps * 10, 2)],
                [torch.randn(steps * 10, 2)],
                [torch.randn(steps * 10, 2)],
                [torch.randn(steps * 10, 2)],
            )
            checkpoints.save(path, f"job{rank}", ONE_PASS, FitState(stats, batches_done=steps))
    assert run_two_ranks(_resume_main, checkpoint, layout) == [0, 0]
    assert [json.loads((tmp_path / f"resumed.rank{r}.json").read_text()) for r in range(2)] == [[2, 20], [2, 20]]


def test_owned_layers_cover_every_target_layer_once():
    assert [owned_layers(7, r, 3) for r in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [owned_layers(64, r, 8)[0] for r in range(8)] == list(range(0, 64, 8))
    with pytest.raises(ConfigError, match="at most 3 processes"):
        owned_layers(3, 0, 4)


@pytest.mark.slow
def test_kvhub_fit_distributed_launches_torchrun_and_registers_once(tmp_path, text_corpus):
    """The CLI path end to end: kvhub fit --distributed 2 (torchrun, gloo) gives the single-process mapper."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    from tests.fixtures_calib import train_tokenizer

    tokenizer = train_tokenizer()
    for name, seed, layers in (("src", 4, 2), ("dst", 5, 3)):
        make_model("qwen2", vocab_size=640, num_hidden_layers=layers, seed=seed).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    env = {
        **os.environ,
        "KVHUB_CACHE": str(tmp_path / "cache"),
        "KVHUB_HOME": str(tmp_path / "home"),
        "OMP_NUM_THREADS": "1",
    }

    def kvhub_fit(out, *extra):
        args = tiny_fit_args(
            tmp_path / "src",
            tmp_path / "dst",
            *extra,
            calib=text_corpus,
            samples=8,
            batch_size=2,
            db=f"sqlite:///{tmp_path / 'store.db'}",
            out=out,
            json=True,
        )
        done = subprocess.run(
            [sys.executable, "-m", "kvhub", *args], env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout[done.stdout.index("{") :])

    distributed = kvhub_fit(tmp_path / "two", "--distributed", "2")
    single = kvhub_fit(tmp_path / "one")
    two, one = (load_file(str(tmp_path / d / "mapper.safetensors")) for d in ("two", "one"))
    for name in one:
        torch.testing.assert_close(two[name].double(), one[name].double(), rtol=0, atol=1e-6, msg=name)
    identical = all(torch.equal(two[name], one[name]) for name in one)  # the store keeps those as one version
    assert distributed["ref"].endswith("@v1")
    assert single["ref"] == (distributed["ref"] if identical else distributed["ref"][:-1] + "2")
    assert not list((tmp_path / "cache" / "checkpoints").glob("*"))


def test_two_phase_capture_on_two_ranks_equals_one_process_also_after_a_rank_dies(tmp_path, monkeypatch):
    """Each rank spools its own batches with the source alone, then runs the target alone; rank 1 killed in
    phase 2 resumes from its checkpoint and its spool, and the mapper equals the one-process one-phase fit."""
    monkeypatch.setenv("KVHUB_CACHE", str(tmp_path / "cache"))
    family = _family()
    single = _single(family, _options())
    phased = _options(capture="two-phase")
    codes = _run_ranks(tmp_path, family, phased, die_at=["capture", DIE_AT_STEP])
    assert codes[1] == 3
    assert len(list((tmp_path / "cache" / "spool").iterdir())) == 2  # one spool per rank, kept for the rerun
    assert _run_ranks(tmp_path, family, phased) == [0, 0]
    _assert_same_mapper(tmp_path, single)
    assert json.loads((tmp_path / "metadata.json").read_text())["fit"]["capture"] == "two-phase"
    assert not list((tmp_path / "cache" / "spool").iterdir())  # every rank removed its spool


def test_a_layer_outer_target_on_two_ranks_equals_the_one_process_fit(tmp_path, monkeypatch):
    """Each rank sweeps the target layer by layer over its own batches; the owner of each target layer merges
    every rank's rows in batch order: the mapper of the one-process whole-target fit."""
    monkeypatch.setenv("KVHUB_CACHE", str(tmp_path / "cache"))
    family = _family()
    single = _single(family, _options(statistics=ONE_PASS))
    assert _run_ranks(tmp_path, family, _options(statistics=ONE_PASS, target_layout="layer-outer")) == [0, 0]
    _assert_same_mapper(tmp_path, single)
    fit_block = json.loads((tmp_path / "metadata.json").read_text())["fit"]
    assert (fit_block["capture"], fit_block["target_layout"]) == ("two-phase", "layer-outer")
    steps = json.loads((tmp_path / "steps.rank0.json").read_text())
    assert [label for label, _ in steps][:2] == ["target layer 1/3", "target layer 1/3"]  # 4 steps per sweep
    assert not list((tmp_path / "cache" / "spool").iterdir())
