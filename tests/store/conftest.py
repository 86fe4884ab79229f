"""Tests of the store (kvhub.store): registering, references, aliases, series and their calibration text,
lineage, migrations, concurrency, read-only and full stores, the store commands.  Shared helpers stay at
tests/ (from tests.x import ...); fixtures only these files use live here."""
