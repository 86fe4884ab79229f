"""Tests of cross-cutting contracts of the whole package: the layering of its stages, security fixes, every
bad input and clean refusal, the documentation (cli.md, documented commands) and the newcomer's walkthrough.
Shared helpers stay at tests/ (from tests.x import ...); fixtures only these files use live here."""
