"""The PEFT-like Python API: Mapper.from_pretrained (directory, store reference, Hub repository),
save_pretrained, push_to_hub, and ``ref`` / ``repr`` naming the version."""

from __future__ import annotations

import pytest
import torch

import kvhub
from kvhub.errors import ConfigError, NotFoundError
from kvhub.store import open_store
from tests.fixtures_hub import DST_ID, SRC_ID, make_artifact, register

SERIES = f"{SRC_ID}:{DST_ID}:legal-docs"


def same_tensors(a, b) -> bool:
    return a.tensors.keys() == b.tensors.keys() and all(torch.equal(a.tensors[n], b.tensors[n]) for n in a.tensors)


def test_from_pretrained_by_store_reference_and_directory(tmp_path):
    db = str(tmp_path / "store.db")
    register(db, tmp_path / "a1", seed=1)
    v2 = register(db, tmp_path / "a2", seed=2)
    with open_store(db) as store:
        store.tag(f"{SERIES}@v1", "production")

    production = kvhub.Mapper.from_pretrained(f"{SERIES}@production", db=db)
    assert production.ref == f"{SERIES}@v1" and repr(production).startswith(f"Mapper({SERIES}@v1, 3 target layers")
    loaded = kvhub.load(SRC_ID, DST_ID, db=db, version=2)
    assert loaded.ref == v2.ref == f"{SERIES}@v2"

    saved = production.save_pretrained(tmp_path / "saved")
    again = kvhub.Mapper.from_pretrained(str(saved), db=db)
    assert same_tensors(again, production) and again.ref == f"{SERIES}@v1"  # the store holds these tensors
    stray = kvhub.Mapper.from_pretrained(make_artifact(tmp_path / "stray", seed=9), db=db)
    assert stray.ref is None and "not in a store" in repr(stray)


def test_from_pretrained_refuses_what_it_cannot_name(tmp_path):
    with pytest.raises(ConfigError, match="neither an artifact directory"):
        kvhub.Mapper.from_pretrained("no such thing", db=str(tmp_path / "store.db"))
    with pytest.raises(NotFoundError, match="no kvhub store"):
        kvhub.Mapper.from_pretrained(f"{SERIES}@v1", db=str(tmp_path / "typo.db"))
    assert not (tmp_path / "typo.db").exists()


@pytest.mark.hub
def test_push_to_hub_then_from_pretrained_by_repository(hub_env):
    fitted = kvhub.Mapper.from_pretrained(make_artifact(hub_env.tmp / "fresh", seed=3), db=str(hub_env.tmp / "a.db"))
    assert fitted.ref is None
    result = fitted.push_to_hub("alice/kvmap-api", db=str(hub_env.tmp / "a.db"))
    assert result.tag == "v1" and fitted.ref == f"{SERIES}@v1"  # registered, then published as its version
    assert hub_env.server.repo("alice/kvmap-api")["tags"]["v1"] == result.commit_sha
    assert fitted.push_to_hub("alice/kvmap-api", db=str(hub_env.tmp / "a.db")).already_published

    other = str(hub_env.tmp / "b.db")
    pulled = kvhub.Mapper.from_pretrained("alice/kvmap-api@v1", db=other)
    assert same_tensors(pulled, fitted) and pulled.ref == f"{SERIES}@v1"
    with open_store(other) as store:
        assert store.resolve(pulled.ref).lineage["hub"]["repo_id"] == "alice/kvmap-api"


@pytest.mark.parametrize(
    ("selector", "match"),
    [
        ({"version": 0}, "version numbers run from 1"),
        ({"version": "v0"}, "version numbers run from 1"),
        ({"version": 2.5}, "a version is a number"),
        ({"version": "bad name!"}, "cannot be an alias"),
        ({"alias": "v3"}, "cannot be an alias"),
        ({"version": 3, "alias": "production"}, "either a version or an alias"),
    ],
)
def test_load_refuses_a_malformed_selector_before_reading_any_store(tmp_path, selector, match):
    with pytest.raises(ConfigError, match=match):
        kvhub.load(SRC_ID, DST_ID, db=str(tmp_path / "store.db"), **selector)
    assert not (tmp_path / "store.db").exists()


@pytest.mark.parametrize("hub_configured", [False, True])
def test_every_miss_of_load_is_a_not_found_error_with_a_next_step(tmp_path, monkeypatch, hub_configured):
    """Aliases other than latest are names in this store: with a Hub source configured they are still
    local misses (``version="production"`` used to fall through to the Hub's newest version)."""
    if hub_configured:
        monkeypatch.setenv("KVHUB_HUB_NAMESPACES", "alice")  # offline (conftest), an empty Hugging Face cache
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    db = str(tmp_path / "store.db")
    no_store = "in the local Hugging Face cache under alice" if hub_configured else "no kvhub store"
    with pytest.raises(NotFoundError, match=f"{no_store}.*`kvhub fit`"):
        kvhub.load(SRC_ID, DST_ID, db=db)
    register(db, tmp_path / "a1", seed=1)
    misses = [
        ({"version": "production"}, "has no alias 'production'; set it with `kvhub tag"),
        ({"alias": "staging"}, "has no alias 'staging'; set it with `kvhub tag"),
        ({"calib": "other-docs"}, "other-docs.*`kvhub fit`"),
        (
            {"version": 7},
            "v7 in the store or in the local Hugging Face cache"
            if hub_configured
            else r"has no version v7 \(versions: v1\); name one of those",
        ),
        ({"src": "someone/else"}, "`kvhub fit`"),
    ]
    for selector, match in misses:
        names = {"src": SRC_ID, "dst": DST_ID, **selector}
        with pytest.raises(NotFoundError, match=match):
            kvhub.load(names.pop("src"), names.pop("dst"), db=db, **names)
    assert kvhub.load(SRC_ID, DST_ID, db=db, version="latest").ref == f"{SERIES}@v1"


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("./not/here", "neither an artifact directory"),
        ("../up", "neither an artifact directory"),
        ("a/b/c", "neither an artifact directory"),
        ("kvmap", "neither an artifact directory"),
        ("a:b:c:d", "is not a mapper reference"),
        ("a:b@", "names no version or alias"),
        ("a:b@v0", "run from 1"),
    ],
)
def test_from_pretrained_parses_names_with_the_store_and_hub_parsers(tmp_path, name, match):
    with pytest.raises(ConfigError, match=match):
        kvhub.Mapper.from_pretrained(name, db=str(tmp_path / "store.db"))
    assert not (tmp_path / "store.db").exists()


# ---- kvhub.handoff takes what model.generate takes (U6) ------------------------------------------------------
@pytest.fixture(scope="module")
def handoff_family(tmp_path_factory):
    from kvhub.fitting.fit import fit
    from kvhub.fitting.options import FitOptions
    from tests.fixtures_calib import save_tiny_family

    source, target, tokenizer = save_tiny_family(tmp_path_factory.mktemp("handoff"))
    ids = torch.randint(0, 640, (16, 32), generator=torch.Generator().manual_seed(0))
    mapper = fit(
        source,
        target,
        ids[:12],
        ids[12:],
        source_id="tiny/src",
        target_id="tiny/dst",
        source_tokenizer=tokenizer,
        target_tokenizer=tokenizer,
        options=FitOptions(ridge_lambda=1e-9, stride=1, batch_size=8),
    )
    return mapper, source, target, tokenizer


def test_handoff_takes_the_tokenizers_output_as_generate_does(handoff_family):
    """`handoff(m, src, dst, **tokenizer(text, return_tensors="pt"))` and an explicit all-ones attention_mask
    generate what `target.generate(**inputs)` does (an exact family); it used to fail with "got multiple values
    for keyword argument 'attention_mask'"."""
    mapper, source, target, tokenizer = handoff_family
    inputs = tokenizer("d001 d002 d003 d011 d012 d013 d020 d021", return_tensors="pt")
    want = target.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert torch.equal(kvhub.handoff(mapper, source, target, **inputs, max_new_tokens=4, do_sample=False), want)
    explicit = kvhub.handoff(
        mapper,
        source,
        target,
        inputs["input_ids"],
        attention_mask=inputs["attention_mask"],
        max_new_tokens=4,
        do_sample=False,
    )
    assert torch.equal(explicit, want)


def test_handoff_refuses_text_and_padding_naming_what_to_pass(handoff_family):
    mapper, source, target, tokenizer = handoff_family
    with pytest.raises(TypeError, match=r"token ids, got text.*\*\*tokenizer\(text, return_tensors='pt'\)"):
        kvhub.handoff(mapper, source, target, "some text", max_new_tokens=2)
    with pytest.raises(TypeError, match="got no input_ids"):
        kvhub.handoff(mapper, source, target, max_new_tokens=2)
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 0]])
    with pytest.raises(ConfigError, match="unpadded"):
        kvhub.handoff(
            mapper, source, target, ids, attention_mask=torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]), max_new_tokens=2
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize(
    "device,says", [("cuda", "CUDA is not available here; use device='cpu'"), ("h100", "'h100' is not a device")]
)
def test_a_device_this_machine_lacks_is_one_clear_error(tmp_path, device, says):
    """ux-2 U5: from_pretrained(..., device='cuda') on a CPU machine said only safetensors' pin_memory error."""
    directory = make_artifact(tmp_path / "a", seed=1)
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        kvhub.Mapper.from_pretrained(directory, device=device, db=str(tmp_path / "store.db"))


def test_one_door_resolves_every_kind_of_name_without_loading_tensors(tmp_path, monkeypatch):
    """api.resolve is the one door: a store reference, a Ref, a directory (registered or not) each give the
    directory, the ref and the two model ids, and nothing loads a tensor on the way; load and from_pretrained
    (module function and classmethod, one signature) go through it.  Planted bugs caught: resolve loading the
    mapper (safetensors' load_file called); a stray directory given a ref; the module from_pretrained keeping a
    second copy of the options (a keyword it no longer forwards)."""
    import inspect

    import safetensors.torch

    from kvhub import api
    from kvhub.store.refs import Ref

    db = str(tmp_path / "store.db")
    v1 = register(db, tmp_path / "a1", seed=1)
    stray = make_artifact(tmp_path / "stray", seed=9)
    loads = []
    real = safetensors.torch.load_file
    monkeypatch.setattr(safetensors.torch, "load_file", lambda *a, **k: loads.append(a) or real(*a, **k))

    by_text = api.resolve(f"{SERIES}@v1", db=db)
    by_ref = api.resolve(Ref.of(SRC_ID, DST_ID, calibration="legal-docs"), db=db)
    assert by_text.ref == by_ref.ref == v1.ref and (by_text.source_id, by_text.target_id) == (SRC_ID, DST_ID)
    assert by_text.directory == by_ref.directory and by_text.version.id == v1.id
    registered = api.resolve(str(by_text.directory), db=db)
    assert registered.ref == v1.ref and registered.directory == by_text.directory
    unregistered = api.resolve(stray, db=db)
    assert unregistered.ref is None and unregistered.version is None and unregistered.source_id == SRC_ID
    assert unregistered.deshrink_setting("off") == "off"
    assert loads == []  # ids, refs and the deshrink check without a tensor read

    assert api.from_pretrained(f"{SERIES}@v1", db=db, compute_dtype=torch.float32).ref == v1.ref
    assert loads, "from_pretrained loads the tensors"
    assert list(inspect.signature(api.from_pretrained).parameters) == ["args", "kwargs"]
