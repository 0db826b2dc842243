"""The cyclic garbage collector, out of the way while the run builds its million-object tables.

A listing of a million files is a million entries, its plan a million shards, its schedule a
million extents: tuples, made once and kept for the run, in no reference cycle. While they
are made, CPython's collector runs again and again and walks everything alive so far (its
full collections grow with the heap): for 1,000,000 files on 1,024 ranks, decode, plan and
schedule took 11.8 s with it running and 4.9 s without (benchmarks/scale.py). So the stages
that build them run with the collector paused, and what they built is then frozen (moved to
the collector's permanent generation: never walked again) until the run ends.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No cyclic collection inside the block; what is alive at its end is frozen (see the module).

    Reference counting still frees what is dropped; only garbage in cycles waits, and the
    stages inside make almost none. The collector's former state is restored.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def thaw() -> None:
    """The run is over: what was frozen goes back to the collector (a host program of the
    Python API keeps a normal heap)."""
    gc.unfreeze()
