"""Offline, the Hub commands say so once: huggingface_hub's warnings come out one line each (through kvhub's log
handler, not also through the stream handler huggingface_hub adds when its utilities load), and a host that
cannot be reached ends with the setting that skips the network."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvhub.errors import HubError

FRESH_PROCESS = """
import logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
from kvhub.hub.client import hub_settings
hub_settings()
from huggingface_hub import HfApi  # what search, push and pull import next
logging.getLogger("huggingface_hub.utils._http").warning("Retrying in 1s [Retry 1/5].")
"""


def test_a_hub_warning_is_printed_once():
    """Planted bugs caught: huggingface_hub's own stderr handler left on (ux-4 U4-8: every retry warning twice,
    raw and as `WARNING huggingface_hub.utils._http: ...`) because it was looked for before huggingface_hub's
    logging module had loaded and added it."""
    done = subprocess.run([sys.executable, "-c", FRESH_PROCESS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "Retrying in 1s" in line]
    assert lines == ["WARNING huggingface_hub.utils._http: Retrying in 1s [Retry 1/5]."], done.stderr


def test_an_unreachable_host_names_the_offline_setting():
    """Planted bugs caught: a DNS or refused-connection failure that ends without saying how to work from the
    cache (ux-4 U4-8: 24 s of retries and no hint)."""
    import httpx2

    from kvhub.hub.client import hub_errors

    with pytest.raises(HubError) as refused:
        with hub_errors("search the Hub", repo_id=None):
            raise httpx2.ConnectError("[Errno -2] Name or service not known")
    assert "the connection to" in str(refused.value) and "HF_HUB_OFFLINE=1" in str(refused.value)
