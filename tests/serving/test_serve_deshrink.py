"""`kvhub serve --deshrink` is checked against the mapper before anything starts, --dry-run included: kv or v
on a mapper without target means is refused as `kvhub eval --deshrink` refuses it (R3-13 of
docs/reviews/reliability-3.md); the consumer would otherwise fail at start."""

from __future__ import annotations

import pytest

from kvhub.errors import ConfigError
from tests.serving.test_serve import _invoke, _serve_args, fake_vllm, mapper_db  # noqa: F401  (fixtures)

# the fixture mapper has no target_mean tensors (artifact format 2)
DESHRINK_ON_A_MAPPER_WITHOUT_MEANS = [
    pytest.param("kv", ConfigError.exit_code, "target_mean", id="serve-deshrink-kv-refused"),
    pytest.param("v", ConfigError.exit_code, "target_mean", id="serve-deshrink-v-refused"),
    pytest.param("off", 0, "", id="serve-deshrink-off-accepted"),
]


@pytest.mark.parametrize("deshrink, exit_code, text", DESHRINK_ON_A_MAPPER_WITHOUT_MEANS)
def test_serve_dry_run_checks_deshrink(
    mapper_db,
    tmp_path,
    fake_vllm,
    deshrink,
    exit_code,  # noqa: F811
    text,
):
    result = _invoke(
        *_serve_args(
            mapper_db, tmp_path, fake_vllm, [8001, 8002], "--dry-run", "--kv-cache-gib", "2", "--deshrink", deshrink
        )
    )
    assert result.exit_code == exit_code, result.output
    assert text in result.output and "Traceback" not in result.output
