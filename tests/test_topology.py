"""Unit and property tests for grouping ranks by node (azcp_cluster/topology.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from azcp_cluster.errors import UsageError
from azcp_cluster.topology import group_ranks


def test_one_rank_per_node_is_everyone_leader_and_downloader() -> None:
    topo = group_ranks([("a", "/d"), ("b", "/d"), ("c", "/d")])
    assert topo.group_of == (0, 1, 2) and topo.leaders == (0, 1, 2)
    assert topo.downloaders == (0, 1, 2) and topo.hosts == 3 and topo.groups == 3
    assert all(topo.is_leader(r) for r in range(3))


def test_same_host_same_dest_is_one_group_with_one_leader() -> None:
    topo = group_ranks([("n1", "/nvme")] * 4)
    assert topo.groups == 1 and topo.leaders == (0,) and topo.hosts == 1
    assert [topo.is_leader(r) for r in range(4)] == [True, False, False, False]
    assert topo.downloaders == (0, 1, 2, 3)


def test_rank_placeholder_makes_one_group_per_rank_on_one_host() -> None:
    topo = group_ranks([("n1", f"/x/{r}") for r in range(4)])
    assert topo.groups == 4 and topo.hosts == 1 and topo.leaders == (0, 1, 2, 3)


def test_block_placement_two_nodes_of_four() -> None:
    places = [("n1", "/d")] * 4 + [("n2", "/d")] * 4
    topo = group_ranks(places)
    assert topo.leaders == (0, 4) and topo.group_of == (0, 0, 0, 0, 1, 1, 1, 1)
    assert topo.members(1) == [4, 5, 6, 7] and topo.group_of[6] == 1
    # Downloaders round-robin over the nodes: leaders first, then each node's next rank.
    assert group_ranks(places, download_ranks=2).downloaders == (0, 4)
    assert group_ranks(places, download_ranks=3).downloaders == (0, 1, 4)
    assert group_ranks(places, download_ranks=100).downloaders == tuple(range(8))


def test_cyclic_placement() -> None:
    places = [("n1", "/d"), ("n2", "/d")] * 3
    topo = group_ranks(places, download_ranks=4)
    assert topo.leaders == (0, 1) and topo.downloaders == (0, 1, 2, 3)


def test_reader_leads_its_group() -> None:
    topo = group_ranks([("n1", "/d")] * 4, preferred_leader=2)
    assert topo.leaders == (2,) and topo.is_leader(2) and not topo.is_leader(0)
    # The reader's group's downloaders start with it.
    assert group_ranks([("n1", "/d")] * 4, preferred_leader=2, download_ranks=1).downloaders == (2,)


@pytest.mark.parametrize(("reader", "k"), [(4, None), (-1, None), (None, 0), (None, -3)])
def test_bad_roles_are_usage_errors(reader: int | None, k: int | None) -> None:
    with pytest.raises(UsageError):
        group_ranks([("n1", "/d")] * 4, preferred_leader=reader, download_ranks=k)


@given(
    places=st.lists(st.tuples(st.sampled_from("abc"), st.sampled_from(["/d", "/e"])), min_size=1, max_size=24),
    data=st.data(),
)
@settings(max_examples=200, deadline=None)
def test_roles_are_consistent(places: list[tuple[str, str]], data: st.DataObject) -> None:
    size = len(places)
    reader = data.draw(st.none() | st.integers(0, size - 1))
    k = data.draw(st.none() | st.integers(1, size + 2))
    topo = group_ranks(places, preferred_leader=reader, download_ranks=k)
    # Exactly one leader per distinct place, and it is a member of its group.
    assert topo.groups == len(set(places))
    for g, leader in enumerate(topo.leaders):
        assert topo.group_of[leader] == g
        assert {places[r] for r in topo.members(g)} == {places[leader]}
    assert sum(topo.is_leader(r) for r in range(size)) == topo.groups
    if reader is not None:
        assert topo.is_leader(reader)
    # K downloaders (all by default), distinct, and spread: no group gets a second before all get one.
    count = size if k is None else min(k, size)
    assert len(topo.downloaders) == count == len(set(topo.downloaders))
    per_group = [sum(1 for r in topo.downloaders if topo.group_of[r] == g) for g in range(topo.groups)]
    sizes = [len(topo.members(g)) for g in range(topo.groups)]
    for p_g, s_g in zip(per_group, sizes, strict=True):
        assert all(p_g >= min(s_g, p_h - 1) for p_h in per_group), f"not round-robin: {per_group} of {sizes}"
    # Within a group, its leader downloads first.
    assert all(topo.leaders[g] in topo.downloaders for g in range(topo.groups) if per_group[g])
    assert group_ranks(places, preferred_leader=reader, download_ranks=k) == topo
