"""Numeric tolerances derived from the dtype a result is computed in, not picked by hand.

With ``eps = torch.finfo(dtype).eps``, one rounding has relative error <= eps / 2.  A sum or dot product of
``terms`` terms has error <= terms * eps in the worst case; for the independent rounding errors of random
data it grows like sqrt(terms) * eps, and that is the model used here, times SAFETY.  A solve multiplies
the relative error of its inputs by the condition number of its matrix.  So the relative tolerance is

    rtol = SAFETY * condition * sqrt(terms) * eps(dtype)

kvhub's statistics multiply in fp32 and keep fp64 totals (kvhub/core/stats.py), and the tiny test models run in
fp32: float32 is the dtype of almost every comparison.  Absolute tolerances are that relative tolerance
times the scale of the expected values, so a comparison is as strict for small numbers as for large ones.
"""

from __future__ import annotations

import math

import torch

SAFETY = 8  # head-room over the sqrt(terms) estimate; the worst case (terms * eps) is far looser


def eps(dtype: torch.dtype = torch.float32) -> float:
    """Machine epsilon of ``dtype`` (float32: 1.19e-7, float64: 2.2e-16)."""
    return torch.finfo(dtype).eps


def rtol(dtype: torch.dtype = torch.float32, terms: int = 1, *, condition: float = 1.0) -> float:
    """Relative tolerance of a value computed with ``terms``-term sums in ``dtype`` (module docstring)."""
    return SAFETY * condition * math.sqrt(terms) * eps(dtype)


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float32,
    terms: int = 1,
    condition: float = 1.0,
    msg: str | None = None,
) -> None:
    """``torch.testing.assert_close`` with rtol = :func:`rtol` and atol = rtol * max|expected|."""
    tolerance = rtol(dtype, terms, condition=condition)
    scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected.to(actual.dtype), rtol=tolerance, atol=tolerance * scale, msg=msg)


def condition_number(x: torch.Tensor) -> float:
    """cond(Xc^T Xc) of the centred rows of ``x`` (N, p): how much a ridge solve amplifies rounding."""
    centred = x.double() - x.double().mean(0)
    return float(torch.linalg.cond(centred.T @ centred))


def cache_condition(model, ids: torch.Tensor) -> float:
    """The largest cond(Xc^T Xc) over ``model``'s per-layer keys and values on ``ids``: the amplification
    of rounding by a (near-unregularised) ridge map fitted on that model's cache."""
    from kvhub.core.capture import run_model

    worst = 1.0
    for layer in run_model(model, ids).layers:
        for kv in (layer.keys, layer.values):  # (B, H, T, D) -> rows (B*T, H*D)
            worst = max(worst, condition_number(kv.transpose(1, 2).reshape(-1, kv.shape[1] * kv.shape[3])))
    return worst
