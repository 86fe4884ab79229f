"""Tests of the on-disk mapper format (kvhub.artifact): format versions and what older releases say.  Shared
helpers stay at tests/ (from tests.x import ...); fixtures only these files use live here."""
