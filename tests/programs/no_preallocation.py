"""Run the CLI as on a filesystem that cannot reserve blocks (NFSv3, many FUSE mounts).

``fallocate(2)`` is taken away, so every temporary file is extended sparse, as
``localfs.preallocate`` does where the filesystem answers EOPNOTSUPP: a full disk then
shows in the middle of the copy, not at allocation.
"""

from __future__ import annotations

import sys

from azcp_cluster.cli import main
from azcp_cluster.dest import localfs

localfs._FALLOCATE = None

if __name__ == "__main__":
    sys.exit(main())
