"""`kvhub-lm-eval -h` says that --model kvhub exists and which model_args it takes (ux-3 U3-23), before
lm-eval's own help."""

from __future__ import annotations

import pytest

pytest.importorskip("lm_eval")


def test_U3_23_help_names_the_kvhub_model_and_its_args(capsys):
    from kvhub.eval.lmeval import DEFAULTS, main

    with pytest.raises(SystemExit) as done:
        main(["-h"])
    assert done.value.code in (0, None)
    out = capsys.readouterr().out
    head, _, rest = out.partition("lm-eval's own help follows")
    assert "--model kvhub" in head and "mapper=REF" in head and rest.strip()
    for key in ("condition", "exact_prefix", "deshrink", "db"):
        assert key in head and key in DEFAULTS
