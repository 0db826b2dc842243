"""The cyclic garbage collector, out of the way while the run builds its million-object tables.

A listing of a million files is a million entries, its plan a million shards, its schedule a
million extents: tuples, made once and kept for the run, in no reference cycle. While they
are made, CPython's collector runs again and again and walks everything alive so far (its
full collections grow with the heap): for 1,000,000 files on 1,024 ranks, decode, plan and
schedule took 11.8 s with it running and 4.9 s without (benchmarks/scale.py). So the stages
that build them run with the collector paused, and what they built is then frozen (moved to
the collector's permanent generation: never walked again) for the rest of the run.

Freezes are counted (the download freezes the heap too, for its event loop): the heap is
thawed when the last hold ends, and only if it was not frozen before the first (a host
program of the Python API that froze its own heap keeps it frozen).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_holds = 0
_thaw_at_end = False  # whether the heap was unfrozen when the first hold began


def hold() -> None:
    """Freeze the heap (what is alive now is never walked by the collector until released)."""
    global _holds, _thaw_at_end
    with _lock:
        if _holds == 0:
            _thaw_at_end = gc.get_freeze_count() == 0
        gc.freeze()
        _holds += 1


def release() -> None:
    """End one :func:`hold`; the last one thaws the heap (unless it was frozen before)."""
    global _holds
    with _lock:
        if _holds == 0:
            return
        _holds -= 1
        if _holds == 0 and _thaw_at_end:
            gc.unfreeze()


@contextlib.contextmanager
def frozen() -> Iterator[None]:
    """The heap frozen for the block (see :func:`hold`)."""
    hold()
    try:
        yield
    finally:
        release()


class Hold:
    """A :func:`paused` block's freeze, held from its normal end until :meth:`end`."""

    def __init__(self) -> None:
        self.held = False

    def end(self) -> None:
        """Release the freeze (once; nothing if the block did not end normally)."""
        if self.held:
            self.held = False
            release()


@contextlib.contextmanager
def paused() -> Iterator[Hold]:
    """No cyclic collection inside the block; if it ends normally, what is alive then stays
    frozen until the yielded :class:`Hold` ends (the run's end: pipeline.run).

    Reference counting still frees what is dropped; only garbage in cycles waits, and the
    stages inside make almost none. The collector's former state is restored.
    """
    kept = Hold()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield kept
        hold()  # before the collector runs again
        kept.held = True
    finally:
        if enabled:
            gc.enable()
