"""The schedule stage: the plan cut into the leaders' transfers, and the files they bring to this node.

``schedule_for`` returns a frozen :class:`Schedule`; ``writes_here`` the files this node
writes (and later syncs, verifies, renames). A streamed copy's transfers are as large as
stages/shape.py decides (its one decision on streaming).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from azcp_cluster.core.blocks import MAX_SLOTS
from azcp_cluster.core.columns import distinct
from azcp_cluster.core.config import Config, MiB
from azcp_cluster.core.model import Listing
from azcp_cluster.core.packing import spread_chunk, spread_roots, transfer_schedule
from azcp_cluster.core.plan import Plan, ShardColumns
from azcp_cluster.core.schedule import Transfer, Transfers, files_of, files_written, payload
from azcp_cluster.core.topology import lanes_of
from azcp_cluster.core.waves import TAPER
from azcp_cluster.stages.setup import Placement
from azcp_cluster.stages.shape import stream_sizes_for
from azcp_cluster.stages.survey import Diff


@dataclass(frozen=True)
class Schedule:
    """The transfers between the leaders, and the files they bring to this rank's node."""

    # schedule.Transfers (columns; each Transfer made when read), or any list of them: this
    # rank's rail's (every rail's chain carries what its own lane of each node brought in)
    transfers: Sequence[Transfer]
    receives: frozenset[int]  # files the schedule brings here, on any rail (this and earlier rounds)
    every_rail: int | None = None  # bytes of file data on all the rails (None: one rail, ``payload``)

    @property
    def payload(self) -> int:
        """Bytes of file data in the transfers (not the alignment padding)."""
        return payload(self.transfers)

    @property
    def anywhere(self) -> bool:
        """Some rail has transfers (every rank agrees: with one rail, this rank's schedule's)."""
        return bool(self.transfers) if self.every_rail is None else self.every_rail > 0

    @property
    def total(self) -> int:
        """Bytes of file data the fan-out carries on all its rails."""
        return self.payload if self.every_rail is None else self.every_rail

    @property
    def files(self) -> int:
        """Files with bytes in the transfers."""
        return files_of(self.transfers)


def schedule_for(cfg: Config, local: bool, place: Placement, plan: Plan, earlier: Schedule | None = None) -> Schedule:
    """The transfers between the leaders for ``plan`` (a shard goes out from its owner's leader).

    ``earlier``: a first round's schedule, whose files this node still receives.
    """
    topo = place.topo
    if topo.groups == 1 and not local:
        # One node: the download writes every byte where it belongs and nobody receives, so
        # nothing is fanned out (no slots, no read-back). A local SOURCE still goes through
        # the fan-out: its reader's copy is the one the fan-out writes.
        c = plan.columns
        receives = set(distinct(c.file[c.length > 0]).tolist())
        transfers = Transfers.of([], 1)
    else:
        sizes = stream_sizes_for(cfg, local, place, plan)
        if sizes is not None:
            chunk = sizes.chunk
        elif cfg.fanout == "ibcast":  # a collective per slot: as few as the memory allows
            chunk = cfg.chunk
        else:  # several roots: every one of them in flight at once, round the ring
            c = plan.columns
            loads = np.zeros(topo.groups, dtype=np.int64)
            np.add.at(loads, np.asarray(topo.group_of, dtype=np.int64)[c.owner], c.length)
            roots = spread_roots(loads.tolist())
            chunk = spread_chunk(cfg.chunk, cfg.bcast_pipeline, roots, MAX_SLOTS)
        # Streamed: each root's last transfer tapered as its downloaders' last blocks are.
        tapered = TAPER if sizes is not None else None
        rails = [transfer_schedule(part, chunk, topo.groups, root_of=topo.group_of, tapered=tapered)
                 for part in rail_plans(plan, place)]  # fmt: skip
        transfers = rails[place.lane if place.rails > 1 else 0]
        receives = set().union(*(files_written(t, place.group) for t in rails))
        every_rail = sum(payload(t) for t in rails) if place.rails > 1 else None
        if earlier is not None:
            receives |= earlier.receives
        return Schedule(transfers, frozenset(receives), every_rail)
    if earlier is not None:
        receives |= earlier.receives
    return Schedule(transfers, frozenset(receives))


# With several rails, a plan's shards are cut small enough that each owner gets about this many
# (the rails are cut from the plan by owner: a checkpoint's one large file in a few 1 GiB shards
# would leave most lanes idle), never below a MiB.
SHARDS_PER_OWNER = 4


def shard_size_for(cfg: Config, place: Placement, total: int) -> int:
    """The plan's shard size: ``--shard-size``, or with several rails no larger than a
    :data:`SHARDS_PER_OWNER`-th of each owner's share (rounded up to a MiB)."""
    if place.rails == 1 or not place.owners:
        return cfg.shard_size
    share = -(-total // (SHARDS_PER_OWNER * len(place.owners)))
    return min(cfg.shard_size, max(MiB, -(-share // MiB) * MiB))


def rail_plans(plan: Plan, place: Placement) -> list[Plan]:
    """The plan cut by rail: each shard on the rail of the lane that owns it (with one rail, the
    plan itself). Every rank cuts it alike."""
    if place.rails == 1:
        return [plan]
    c = plan.columns
    lane_of = np.asarray(lanes_of(place.topo), dtype=np.int64)[c.owner]
    return [
        Plan.of_columns(ShardColumns(*(column[lane_of == lane] for column in c)), plan.nranks, plan.receivers)
        for lane in range(place.rails)
    ]


def writes_here(listing: Listing, diff: Diff, schedule: Schedule) -> tuple[int, ...]:
    """The transferred files this node does not have yet and the schedule brings it, or it kept
    from a stopped run (it writes and renames these); empty files are made on every node."""
    files = listing.files
    receives = schedule.receives
    kept = diff.kept
    return tuple(i for i in diff.transfer if not diff.have[i] and (files[i].size == 0 or i in receives or i in kept))
