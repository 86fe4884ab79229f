"""A newcomer's walk-through (issue 22), as the README tells it, on the tiny family and the local Hub
server: fit from local model folders -> eval -> report -> push with the models' Hub ids -> pull into a
fresh store -> kvhub.load by those Hub ids -> handoff.  Every command succeeds and its stderr holds
nothing but kvhub's own one-line messages (no traceback, no other library's bars or warnings)."""

from __future__ import annotations

import json
import logging
import re

import pytest

from tests.fixtures_hub import run
from tests.fixtures_fit import tiny_fit_args

pytestmark = pytest.mark.hub
HUB_SRC, HUB_DST = "acme/tiny-src", "acme/tiny-dst"
# what only other libraries print: tracebacks, log lines in logging's default formats, warnings, tqdm bars
FOREIGN = re.compile(r"Traceback|^(WARNING|INFO|DEBUG|ERROR):? |Warning: |\d+(\.\d+)?it/s|\|[█▏▎▍▌▋▊▉ ]+\||^\s")


def kvhub_lines_only(result, command: str) -> None:
    assert result.exit_code == 0, f"kvhub {command}: {result.stderr}"
    for line in result.stderr.splitlines():
        assert line.strip() and not FOREIGN.search(line), f"kvhub {command} printed {line!r}"


def test_fit_eval_report_push_pull_load_handoff(tiny_model_dirs, text_corpus, hub_env, caplog, tmp_path, monkeypatch):
    import kvhub
    from kvhub.serving.handoff import handoff
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pytest.importorskip("matplotlib", reason="kvhub report needs matplotlib")
    caplog.set_level(logging.WARNING)
    monkeypatch.setenv("KVHUB_CACHE", str(tmp_path / "cache"))  # its evaluation results stay out of the user's cache
    src, dst = tiny_model_dirs
    db, fresh = str(tmp_path / "mine.db"), str(tmp_path / "fresh.db")
    fitted = run(
        *tiny_fit_args(src, dst, calib=text_corpus, stride=None, db=db, json=True),
    )
    kvhub_lines_only(fitted, "fit")
    ref = json.loads(fitted.stdout)["ref"]
    evaluated = run(
        "eval",
        ref,
        "--task",
        "ppl",
        "--ppl-calib",
        str(text_corpus),
        "--limit",
        "2",
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--db",
        db,
    )
    kvhub_lines_only(evaluated, "eval")
    reported = run("report", ref, "--out", str(tmp_path / "report"), "--db", db)
    kvhub_lines_only(reported, "report")
    pushed = run(
        "push",
        ref,
        "--repo",
        "alice/tiny-kvmap",
        "--base-model",
        f"{HUB_SRC},{HUB_DST}",
        "--figures",
        str(tmp_path / "report"),
        "--license",
        "apache-2.0",
        "--db",
        db,
    )
    kvhub_lines_only(pushed, "push")
    card = hub_env.server.file("alice/tiny-kvmap", "v1", "README.md").decode()
    assert "perplexity, mapped cache" in card and "r2_heatmap.png" in card and str(src) not in card

    pulled = run("pull", "alice/tiny-kvmap", "--db", fresh)
    kvhub_lines_only(pulled, "pull")
    mapper = kvhub.load(HUB_SRC, HUB_DST, db=fresh)
    assert mapper.ref == f"{HUB_SRC}:{HUB_DST}:{mapper.metadata['calibration']['name']}@v1"

    tokenizer = AutoTokenizer.from_pretrained(src)
    source, target = (AutoModelForCausalLM.from_pretrained(path, dtype="float32") for path in (src, dst))
    inputs = tokenizer("def main():\n    return 42\n", return_tensors="pt")
    handed = handoff(mapper, source, target, **inputs, max_new_tokens=3, do_sample=False)
    own = target.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert handed.tolist() == own.tolist()  # the exact family: the mapped cache continues like the target's own
    foreign = [r for r in caplog.records if r.levelno >= logging.WARNING and not r.name.startswith("kvhub")]
    assert not foreign, [f"{r.name}: {r.getMessage()}" for r in foreign]
