"""Set operations on integer columns (numpy arrays of file indices, ranks) that the plan and the
schedule use. Pure.

Not ``np.unique``: with numpy 2.x, its plain form (and ``axis=``) imports ``numpy.ma`` the
first time it runs, about 11 ms of one core here, paid inside the run on every rank (eight
ranks on this machine's 2 cores: some 40 ms between the listing and the transfers, of the
3.3 s a streamed 128 MiB copy to 8 hosts of the cluster benchmark takes). A sort and a
comparison with the neighbour give the same answer.
"""

from __future__ import annotations

import numpy as np


def distinct(values: np.ndarray) -> np.ndarray:
    """The distinct values of a 1-D integer array, ascending (what ``np.unique`` returns)."""
    flat = np.sort(np.asarray(values).reshape(-1), kind="stable")
    if len(flat) < 2:
        return flat
    keep = np.empty(len(flat), dtype=np.bool_)
    keep[0] = True
    np.not_equal(flat[1:], flat[:-1], out=keep[1:])
    return flat[keep]


def distinct_pairs(first: np.ndarray, second: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct ``(first[i], second[i])`` pairs of two non-negative integer columns, in
    ascending order of first then second, as two columns."""
    if not all(np.issubdtype(np.asarray(c).dtype, np.integer) for c in (first, second)):
        raise ValueError("the columns must be integers")
    a = np.asarray(first, dtype=np.int64).reshape(-1)
    b = np.asarray(second, dtype=np.int64).reshape(-1)
    if len(a) != len(b):
        raise ValueError("the two columns differ in length")
    if not len(a):
        return a, b
    if int(a.min()) < 0 or int(b.min()) < 0:
        raise ValueError("the columns must not be negative")
    span = int(b.max()) + 1
    if int(a.max()) < (1 << 62) // span:  # one key per pair fits an int64
        keys = distinct(a * span + b)
        return keys // span, keys % span
    order = np.lexsort((b, a))
    a, b = a[order], b[order]
    keep = np.ones(len(a), dtype=np.bool_)
    keep[1:] = (a[1:] != a[:-1]) | (b[1:] != b[:-1])
    return a[keep], b[keep]


__all__ = ["distinct", "distinct_pairs"]
