"""Transitional: kvhub.store.tables under its old name, for kvhub/store/ingest.py until its import says
``kvhub.store.tables`` (issue 23 item 5).  Delete this file then."""

import sys

from kvhub.store import tables

sys.modules[__name__] = tables
