"""The connector's configuration refuses bad values at engine start (ConfigError naming the key), instead
of a raw exception inside vLLM's scheduler or a silent misreading (reliability-2 R4, R11).  Needs vLLM
(the connector module imports it): runs in .venv-vllm through scripts/test-vllm.sh."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvhub.errors import ConfigError  # noqa: E402
from kvhub.serving import vllm_connector as connector  # noqa: E402
from kvhub.serving.spec import Recompute  # noqa: E402


@pytest.mark.parametrize("value, expected", [(16, 16), ("16", 16)], ids=["number", "digits"])
def test_counts_read(value, expected):
    assert connector._config_count({"chunk_tokens": value}, "chunk_tokens") == expected


@pytest.mark.parametrize("value", ["1GiB", "sixteen", 0, -5, True, 1.5, None], ids=str)
def test_bad_counts_are_refused_by_name(value):
    with pytest.raises(ConfigError, match="store_max_bytes must be a positive whole number"):
        connector._config_count({"store_max_bytes": value}, "store_max_bytes")


@pytest.mark.parametrize("value, expected", [(True, True), (False, False), ("false", False), ("True", True)], ids=str)
def test_flags_read(value, expected):
    assert connector._config_flag({"require_isolation_key": value}, "require_isolation_key") is expected


@pytest.mark.parametrize("value", ["no", 1, None], ids=str)
def test_bad_flags_are_refused(value):
    with pytest.raises(ConfigError, match="require_isolation_key must be true or false"):
        connector._config_flag({"require_isolation_key": value}, "require_isolation_key")


def test_events_path_is_checked_at_start(tmp_path):
    assert connector._events_file(str(tmp_path / "e.jsonl")) == str(tmp_path / "e.jsonl")
    for bad in (tmp_path / "missing" / "e.jsonl", tmp_path):
        with pytest.raises(ConfigError, match="events_path"):
            connector._events_file(str(bad))


def test_only_selectors_the_consumer_can_run_are_accepted():
    connector._check_serving_spec(Recompute(exact_budget=0.1, select="target"), origin="x")
    connector._check_serving_spec(Recompute(exact_budget=0.0, select="source"), origin="x")  # nothing selected
    with pytest.raises(ConfigError, match="select='source'"):
        connector._check_serving_spec(Recompute(exact_budget=0.1, select="source"), origin="x")
