"""Tests of the Hub (kvhub.hub, kvhub.api): push, pull, search, cards, versions, faults, the Hugging Face
cache, the PEFT-like Python API.  Shared helpers stay at tests/ (from tests.x import ...); fixtures only these
files use live here."""
