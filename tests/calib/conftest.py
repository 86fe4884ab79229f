"""Tests of calibration sets (kvhub.calib): recipes, building and packing, special files, `kvhub calib`.
Shared helpers stay at tests/ (from tests.x import ...); fixtures only these files use live here."""
