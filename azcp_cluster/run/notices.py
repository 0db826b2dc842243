"""This process's retry notices (core/retry.RetryNotices), said through the console.

The one place that wires them to the console: a retry anywhere in the process (the listing,
the rank's downloads, its download workers' through their rank) is one :data:`NOTICES`.
"""

from __future__ import annotations

import time

from azcp_cluster.core.retry import RetryNotices
from azcp_cluster.run.console import notice

NOTICES = RetryNotices(notice, time.monotonic)  # (none on the terminal under -q)
