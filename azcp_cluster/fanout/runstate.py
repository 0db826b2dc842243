"""What the fan-out's driver keeps for one run beside its machine (fanout/driver.py)."""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from azcp_cluster.core.digests import StreamDigests
from azcp_cluster.core.fanout import FanOut, Hash, Instruction, Read
from azcp_cluster.core.schedule import Transfer
from azcp_cluster.fanout.events import LandingFeed, StageHooks
from azcp_cluster.fanout.readahead import ReadAhead
from azcp_cluster.fanout.transport import Request


@dataclass
class InFlight:
    """A transfer posted and not yet complete."""

    transfer: Transfer
    request: Request
    slot: int


@dataclass
class Run:
    """One run's machine and what the driver keeps beside it."""

    schedule: Sequence[Transfer]
    machine: FanOut
    hooks: StageHooks
    feed: LandingFeed | None
    reader: ReadAhead
    digests: StreamDigests
    threads: list[threading.Thread] = field(default_factory=list)
    reads: queue.SimpleQueue[Read | None] = field(default_factory=queue.SimpleQueue)
    hashes: queue.SimpleQueue[Hash | None] = field(default_factory=queue.SimpleQueue)
    todo: deque[Instruction] = field(default_factory=deque)
    inflight: deque[InFlight] = field(default_factory=deque)  # in posting order
    # What raised while this rank waited in an agreement (the driver's _meanwhile: the machine's
    # or the transport's, which the driver's loop would let out of the run too): raised once it ended.
    meanwhile_error: Exception | None = None


__all__ = ["InFlight", "Run"]
