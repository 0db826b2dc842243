"""azcp_cluster: stage one dataset onto every node of a cluster.

Rank 0 lists the source, every rank computes the same plan, each rank downloads
only its share from Azure, and an MPI broadcast fans every byte out to every node.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
