"""azcp_cluster: stage one dataset onto every node of a cluster.

The source is listed once and each byte is read from it once (from Azure, by the
downloading ranks, each fetching only its share; or from a local path, by one reader),
then an MPI broadcast between nodes fans every byte out to every node.

From Python::

    import azcp_cluster
    report = azcp_cluster.stage("https://acct.blob.core.windows.net/models/llama", "/nvme/llama")

``stage``, ``Report`` and the error classes are imported on first use, so importing the
package (as the command line does for ``--version``) stays cheap.
"""

from __future__ import annotations

TYPE_CHECKING = False  # not typing's: the command imports this package before its signal handlers are in
if TYPE_CHECKING:
    from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "stage": ("azcp_cluster.api", "stage"),
    "Report": ("azcp_cluster.run.report", "Report"),
    "AzcpError": ("azcp_cluster.core.errors", "AzcpError"),
    "UsageError": ("azcp_cluster.core.errors", "UsageError"),
    "CredentialError": ("azcp_cluster.core.errors", "CredentialError"),
    "TopologyError": ("azcp_cluster.core.errors", "TopologyError"),
    "ListError": ("azcp_cluster.core.errors", "ListError"),
    "DiffError": ("azcp_cluster.core.errors", "DiffError"),
    "DownloadError": ("azcp_cluster.core.errors", "DownloadError"),
    "BroadcastError": ("azcp_cluster.core.errors", "BroadcastError"),
    "VerifyError": ("azcp_cluster.core.errors", "VerifyError"),
    "SourceError": ("azcp_cluster.core.errors", "SourceError"),
    "LocalFSError": ("azcp_cluster.core.errors", "LocalFSError"),
    "LockError": ("azcp_cluster.core.errors", "LockError"),
    "Interrupted": ("azcp_cluster.core.errors", "Interrupted"),
    "InternalError": ("azcp_cluster.core.errors", "InternalError"),
}


def __getattr__(name: str) -> Any:
    """Import the public names on first use."""
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'azcp_cluster' has no attribute {name!r}")


__all__ = ["__version__", *_LAZY]
