"""kvhub.dtypes: the one parser of dtype names, shared by model loading, Mapper.load and transfer."""

from __future__ import annotations

import pytest
import torch

from kvhub.dtypes import DTYPE_NAMES, dtype_name, parse_dtype
from kvhub.errors import ConfigError


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("bfloat16", torch.bfloat16),
        ("bf16", torch.bfloat16),
        ("torch.bfloat16", torch.bfloat16),
        (" BF16 ", torch.bfloat16),
        ("fp32", torch.float32),
        ("float", torch.float32),
        ("half", torch.float16),
        ("float16", torch.float16),
        ("double", torch.float64),
        (torch.float16, torch.float16),
        (None, None),
    ],
)
def test_names_aliases_and_dtypes_parse(given, expected):
    assert parse_dtype(given) is expected


@pytest.mark.parametrize("given", ["float13", "int8", "auto", "", torch.int64, torch.bool])
def test_anything_else_is_a_config_error_listing_the_valid_names(given):
    with pytest.raises(ConfigError) as info:
        parse_dtype(given)
    assert all(name in str(info.value) for name in DTYPE_NAMES)


def test_dtype_name_round_trips_through_the_parser():
    for name in DTYPE_NAMES:
        assert dtype_name(getattr(torch, name)) == name and parse_dtype(dtype_name(name)) is getattr(torch, name)
    assert dtype_name("bf16") == "bfloat16"
