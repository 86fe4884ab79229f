"""A --calib path that exists but is no text file (a FIFO, a device, a link to one) is named for what it is,
not "does not exist" (R3-13 of docs/reviews/reliability-3.md)."""

from __future__ import annotations

import os

import pytest

from kvhub.errors import CorpusUnavailableError


def _fifo(tmp_path):
    os.mkfifo(tmp_path / "notes.txt")
    return tmp_path / "notes.txt", "notes.txt is not a regular file"


def _device(tmp_path):
    return "/dev/zero", "/dev/zero is not a regular file"


def _link_to_a_device(tmp_path):
    os.symlink("/dev/urandom", tmp_path / "random.txt")
    return tmp_path / "random.txt", "/dev/urandom is not a regular file"


# the path --calib names, and the text its refusal holds
SPECIAL_FILES = [
    pytest.param(_fifo, id="calib-fifo"),
    pytest.param(_device, id="calib-dev-zero"),
    pytest.param(_link_to_a_device, id="calib-link-to-dev-urandom"),
]


@pytest.mark.parametrize("make", SPECIAL_FILES)
def test_calib_that_is_no_regular_file(tmp_path, make):
    from kvhub.calib.calibration_set import read_documents
    from kvhub.calib.recipe import recipe_from_spec

    path, text = make(tmp_path)
    with pytest.raises(CorpusUnavailableError) as refused:
        read_documents(recipe_from_spec(str(path)))
    assert text in str(refused.value) and "does not exist" not in str(refused.value)
    assert "pass a text file" in str(refused.value)
