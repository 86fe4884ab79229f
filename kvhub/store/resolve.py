"""Transitional: kvhub.store.lookup under its old name, for kvhub/store/ingest.py until its import says
``kvhub.store.lookup`` (issue 23 item 5).  Delete this file then."""

import sys

from kvhub.store import lookup

sys.modules[__name__] = lookup
