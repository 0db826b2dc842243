"""A fan-out slot: one page-aligned buffer that a transfer's bytes pass through on a rank (read
into it by the root, received into it by the others, written from it)."""

from __future__ import annotations

from azcp_cluster.core.plan import round_up
from azcp_cluster.dest.directio import ALIGN, aligned_buffer


class Slot:
    """One pipeline buffer of at least ``size`` bytes; ``populate``: its pages mapped now."""

    def __init__(self, size: int, populate: bool = True) -> None:
        # Whole blocks (an O_DIRECT read of a file's unaligned last extent reads its last block
        # whole), and one byte more: the root's ``intact`` flag after a transfer's bytes (fanout.py).
        self.buffer = aligned_buffer(round_up(size + 1, ALIGN), populate=populate)


__all__ = ["Slot"]
