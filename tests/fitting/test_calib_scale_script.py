"""benchmarks/calib_scale.py end to end on the tiny exact family: one capture pass, one row per size."""

import json

from tests.benchmark_scripts import load_benchmark


def test_each_size_is_solved_on_a_prefix_of_one_draw(tiny_model_dirs, text_corpus, tmp_path, monkeypatch):
    """Rows come in size order, each from exactly its own number of training tokens, scored on the same held-out
    sequences, with forward time that only grows; the saved mappers load and carry their size.  Planted bug
    caught: a batch running past a size's boundary (batch 3 over sizes 4 and 8: the first row would hold 6
    sequences, not 4 x 24 tokens)."""
    from kvhub.core.mapper import Mapper

    monkeypatch.setenv("KVHUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KVHUB_HOME", str(tmp_path / "home"))
    src, dst = tiny_model_dirs
    out, maps = tmp_path / "scale.json", tmp_path / "maps"
    load_benchmark("calib_scale").main(
        [
            "--src",
            str(src),
            "--dst",
            str(dst),
            "--calib",
            str(text_corpus),
            "--sizes",
            "8,4",
            "--seq-len",
            "24",
            "--stride",
            "1",
            "--heldout",
            "2",
            "--batch-size",
            "3",
            "--device",
            "cpu",
            "--artifacts",
            str(maps),
            "--out",
            str(out),
        ]
    )
    report = json.loads(out.read_text())
    assert report["heldout_sequences"] == 2 and report["seq_len"] == 24
    rows = report["sizes"]
    assert [row["sequences"] for row in rows] == [4, 8]
    assert [row["train_tokens"] for row in rows] == [4 * 24, 8 * 24]
    assert rows[0]["forward_s"] <= rows[1]["forward_s"]
    for row in rows:  # an exact family: the maps explain most of the held-out text even from 4 x 24 tokens
        assert row["r2_k_mean"] > 0.9 and row["r2_v_mean"] > 0.9
        mapper = Mapper.load(row["artifact"])
        assert mapper.metadata["calibration"]["samples"] == row["sequences"]
        assert mapper.metadata["metrics"]["train_tokens"] == row["train_tokens"]


def test_mlp_maps_are_trained_on_each_sizes_own_rows(tiny_model_dirs, text_corpus, tmp_path, monkeypatch):
    """--map mlp: each size's MLPs train on exactly that size's rows (the prefix of the kept rows), never score
    below the ridge maps on the same held-out rows, and the saved mapper is of kind mlp.  Planted bug caught:
    training every size on all kept rows (the 4-sequence row would report 8 sequences' rows)."""
    from kvhub.core.mapper import Mapper

    monkeypatch.setenv("KVHUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KVHUB_HOME", str(tmp_path / "home"))
    src, dst = tiny_model_dirs
    out, maps = tmp_path / "scale.json", tmp_path / "maps"
    load_benchmark("calib_scale").main(
        ["--src", str(src), "--dst", str(dst), "--calib", str(text_corpus), "--sizes", "4,8", "--seq-len", "24",
         "--stride", "1", "--heldout", "2", "--batch-size", "3", "--device", "cpu", "--map", "mlp",
         "--mlp-epochs", "3", "--artifacts", str(maps), "--out", str(out)]
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert report["map"] == "mlp"
    for row in report["sizes"]:
        assert row["mlp_train_rows"] == row["train_tokens"]
        for kind in ("k", "v"):
            assert row[f"mlp_r2_{kind}_mean"] >= row[f"mlp_ridge_r2_{kind}_mean"] - 1e-6
            assert 0.9 < row[f"mlp_ridge_r2_{kind}_unseen"] <= 1 and 0.9 < row[f"mlp_r2_{kind}_unseen"] <= 1
        assert row["mlp_stop_rows"] == row["mlp_unseen_rows"] == 24  # 2 held-out sequences: one each
        mapper = Mapper.load(row["artifact"])
        assert mapper.metadata["kind"] == "mlp"
        assert mapper.metadata["mlp"]["tokens"]["train"] == row["train_tokens"]


def test_sizes_must_be_positive_counts():
    import pytest

    scale = load_benchmark("calib_scale")
    assert scale.parse_sizes("64, 16,16") == [16, 64]
    with pytest.raises(SystemExit, match="positive"):
        scale.parse_sizes("0,4")
