"""Tests of evaluation (kvhub.eval): continuation metrics, tasks, long-context and gist scoring, the drop
baseline, results documents and caches, reports, lm-eval, `kvhub eval`, `kvhub bench`, `kvhub eval-serve`.
Shared helpers stay at tests/ (from tests.x import ...); fixtures only these files use live here."""
