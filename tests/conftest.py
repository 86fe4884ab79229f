"""Shared pytest configuration.  Fixture modules of each area are plugged in below."""

import os

# No test may reach the real Hugging Face Hub; a miss must fail fast instead of retrying for ~23 s.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest_plugins = [
    # "tests.fixtures_store",  (one line per fixture module)
    "tests.fixtures_calib",
    "tests.fixtures_store",
    "tests.fixtures_hub",
]
