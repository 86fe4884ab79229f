"""Tests of the math (kvhub.core): RoPE, statistics and solves, the Mapper and its transfer path, compressed,
de-shrunk and mlp maps, layer kinds (hybrids refused), fingerprints, capture compatibility, dtypes.  Shared
helpers stay at tests/ (from tests.x import ...); fixtures only these files use live here."""
