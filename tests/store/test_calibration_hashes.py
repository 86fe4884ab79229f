"""One short hash names a calibration text everywhere (ux-3 U3-22): `kvhub list`'s TEXT, `kvhub show`'s
calibration row and fit's calibration line all give the text's sha256 to 12 characters, labelled
"text"; the built set's content hash, which changes with the size, is labelled "set"."""

from __future__ import annotations

import json

from kvhub.store import open_store
from tests.fixtures_hub import run
from tests.fixtures_store import make_store_artifact

TEXT_SHA = "f82679dc" + "0123456789abcdef" * 3 + "01234567"


def test_list_and_show_give_the_same_text_hash(tmp_path):
    path = make_store_artifact(tmp_path / "a", calibration="notes")
    metadata = json.loads((path / "mapper.json").read_text())
    metadata["calibration"]["corpus_hash"] = TEXT_SHA
    (path / "mapper.json").write_text(json.dumps(metadata))
    db = str(tmp_path / "store.db")
    with open_store(db) as store:
        version = store.register(path)
    listed = run("list", "--db", db)
    shown = run("show", version.ref, "--db", db)
    assert listed.exit_code == 0 and shown.exit_code == 0, listed.output + shown.output
    assert TEXT_SHA[:12] in listed.stdout
    [row] = [line for line in shown.stdout.splitlines() if line.startswith("calibration")]
    assert f"text {TEXT_SHA[:12]}" in row and "set notes-hash" in row


def test_fit_labels_the_text_hash_alike():
    from kvhub.fitting.job import calibration_line

    meta = {"name": "notes", "corpus_hash": TEXT_SHA, "content_hash": "ffafed40fcb6" + "0" * 52}
    line = calibration_line(meta, train=64, heldout=16, tokens=512, stride=2)
    assert line.startswith(f"calibration notes (text {TEXT_SHA[:12]}, set ffafed40fcb6): 64 train + 16 held-out")
    named = calibration_line(meta, train=64, heldout=16, tokens=512, stride=2, series="notes-2")
    assert named.startswith("calibration notes-2 (text")  # the series --name files it under
