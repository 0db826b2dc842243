"""Put on PYTHONPATH by tests/test_workers.py: a download worker that freezes as it starts.

Stands in for a worker stuck on a hung shared filesystem, or stopped (SIGSTOP): it never
reads its job and never says it is alive. Only ``python -m azcp_cluster.download.dlworker`` is held;
every other interpreter starts as usual.
"""

import time

try:
    with open("/proc/self/cmdline", "rb") as _fh:
        _command = _fh.read()
except OSError:
    _command = b""
if b"azcp_cluster.download.dlworker" in _command:
    time.sleep(1000)
