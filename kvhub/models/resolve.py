"""Transitional: kvhub.models.loading under its old name, for kvhub/fitting/job.py until its import says
``kvhub.models.loading`` (issue 23 item 5).  Delete this file then.  An alias of the module itself, not a copy
of its names, so a test that patches ``kvhub.models.loading.load_model`` patches what job.py imports too."""

import sys

from kvhub.models import loading

sys.modules[__name__] = loading
