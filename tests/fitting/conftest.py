"""Tests of fits (kvhub.fitting): FitOptions, the plan, one- and two-pass statistics, weighting, checkpoints,
the distributed fit, `kvhub fit` end to end, the GPU-scale smoke run.  Shared helpers stay at tests/ (from
tests.x import ...); fixtures only these files use live here."""
