"""The shape of a transfer, decided once: streamed or not, the download's sizes and workers, the fan-out's transport.

``stream_sizes_for`` is the one place that decides whether a copy streams (downloads and
fans out at once, core/waves.py): the schedule asks it for a streamed copy's transfer
size before the transfers exist, and :func:`decide` builds from it the frozen
:class:`TransferShape` that the allocate stage hands the transfer stage. Nothing after
allocate decides any of this again.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from azcp_cluster.core.chain import FanoutChoice
from azcp_cluster.core.config import Config
from azcp_cluster.core.plan import Plan
from azcp_cluster.core.topology import workers_for
from azcp_cluster.core.waves import StreamSizes, stream_sizes
from azcp_cluster.download.cpus import allowed as allowed_cpus
from azcp_cluster.stages.setup import Placement


@dataclass(frozen=True)
class TransferShape:
    """How this run's bytes move, the same decision on every rank (but the per-rank fields)."""

    sizes: StreamSizes | None  # a streamed copy's transfer, block and in-flight sizes; None: not streamed
    fetch: Config  # the run's configuration as its download uses it (a streamed copy's blocks and requests)
    unit: int  # the bytes a downloaded block lands in (a streamed copy's transfers' size, else fetch's block)
    workers: int  # this rank's most download worker processes (1: the rank itself; topology.workers_for)
    cpus_sharing: int  # downloading ranks sharing this rank's CPUs
    fanout: FanoutChoice | None = None  # leaders with something to fan out: its transport (core/chain.py)

    @property
    def streamed(self) -> bool:
        """The download and the fan-out run at once (a transfer leaves as soon as its bytes landed)."""
        return self.sizes is not None


def stream_sizes_for(cfg: Config, local: bool, place: Placement, plan: Plan) -> StreamSizes | None:
    """A streamed copy's transfer, block and in-flight sizes (core/waves.py: its shares land, and
    leave, in waves); None for a copy that does not stream: a local SOURCE, one node,
    --no-overlap, nothing to download. The same on every rank: from the largest share.

    A copy with these sizes streams if its schedule has transfers at all (:func:`decide`).
    """
    loads = plan.loads()
    if local or not cfg.overlap or place.topo.groups == 1 or not any(loads):
        return None
    return stream_sizes(max(loads), cfg.chunk, cfg.block_size, cfg.concurrency)


def decide(
    cfg: Config,
    local: bool,
    rank: int,
    place: Placement,
    plan: Plan,
    has_transfers: bool,
    fanout: FanoutChoice | None = None,
) -> TransferShape:
    """The transfer's shape for ``plan`` on this rank: streamed when it has transfers to fan out
    (a one-node run only downloads), its download's configuration and landing unit, how many
    worker processes it may use, and ``fanout`` (the leaders' transport, chosen before)."""
    sizes = stream_sizes_for(cfg, local, place, plan) if has_transfers else None
    fetch = cfg
    unit = cfg.block_size
    if sizes is not None:
        # --download-workers N asks for N processes, each with a request at least.
        in_flight = max(sizes.in_flight, cfg.download_workers or 1)
        fetch = dataclasses.replace(cfg, block_size=sizes.block, concurrency=in_flight)
        # A streamed download's blocks are as small as the transfers, each landing (and its
        # transfer leaving) as soon as its bytes are written, while the downloader fetches
        # consecutive ones in one ranged GET of up to a block (blocks.requests_for): landing
        # whole GETs, the fan-out posted its transfers in bursts, the fabric idle between.
        unit = min(fetch.block_size, sizes.chunk)
    sharing = cpus_sharing(place)
    share = sum(s.length for s in plan.owned_by(rank))
    cpus = len(allowed_cpus())
    workers = min(workers_for(cfg.download_workers, cpus, sharing, share), cfg.concurrency)
    return TransferShape(sizes, fetch, unit, workers, sharing, fanout)


def cpus_sharing(place: Placement) -> int:
    """How many downloading ranks share this rank's CPUs.

    A rank bound to some of the machine's CPUs (Slurm's ``--cpus-per-task``, ``taskset``) has
    them to itself; one that may use them all shares them with the host's other downloaders.
    """
    bound = len(allowed_cpus()) < (os.cpu_count() or 1)
    return 1 if bound else place.downloaders_on_host
