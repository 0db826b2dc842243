"""core/columns.py: the distinct values and pairs of integer columns, against numpy's own unique."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from azcp_cluster.core.columns import distinct, distinct_pairs

ints = st.lists(st.integers(0, 2**40), max_size=200)


@settings(max_examples=300, deadline=None)
@given(ints)
def test_distinct_is_numpys_unique(values: list[int]) -> None:
    column = np.array(values, dtype=np.int64)
    got = distinct(column)
    assert got.dtype == column.dtype
    assert got.tolist() == np.unique(column).tolist()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**40), st.integers(0, 2**40)), max_size=200), st.booleans())
def test_distinct_pairs_are_numpys_unique_rows(pairs: list[tuple[int, int]], huge: bool) -> None:
    a = np.array([p[0] for p in pairs], dtype=np.int64)
    b = np.array([p[1] for p in pairs], dtype=np.int64)
    if huge:  # keys that cannot share one int64 (second values of 1 and more): the lexsort path
        a, b = a + (1 << 61), b + 1
    first, second = distinct_pairs(a, b)
    rows = np.unique(np.stack((a, b), axis=1), axis=0) if len(a) else np.zeros((0, 2), dtype=np.int64)
    assert first.tolist() == rows[:, 0].tolist() and second.tolist() == rows[:, 1].tolist()


def test_distinct_pairs_refuses_columns_that_differ_go_negative_or_are_not_integers() -> None:
    with pytest.raises(ValueError):
        distinct_pairs(np.array([1, 2]), np.array([1]))
    with pytest.raises(ValueError):
        distinct_pairs(np.array([1, -2]), np.array([1, 2]))
    with pytest.raises(ValueError):
        distinct_pairs(np.array([1.7, 1.2]), np.array([1, 1]))  # not truncated into one pair


def test_the_plan_and_schedule_do_not_import_numpy_ma() -> None:
    """The reason for the module: planning and scheduling a copy leave numpy.ma unimported."""
    code = """
import sys
from azcp_cluster.core.packing import transfer_schedule
from azcp_cluster.core.plan import make_plan
from azcp_cluster.core.schedule import files_of, files_written
sizes = [40 << 20, 24 << 20, 4096, 0]
plan = make_plan(sizes, range(4), 4, 8 << 20)
schedule = transfer_schedule(plan, 1 << 20, 4)
assert files_written(schedule, 1) and files_of(schedule)
assert plan.downloaded_files([0, 1]) and plan.files_per_rank()
print("numpy.ma" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
