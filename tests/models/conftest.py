"""Tests of model specs, loading and fetching (kvhub.models).  Shared helpers stay at tests/ (from tests.x
import ...); fixtures only these files use live here."""
