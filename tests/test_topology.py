"""Unit and property tests for grouping ranks by node (azcp_cluster/core/topology.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from azcp_cluster.core.errors import TopologyError, UsageError
from azcp_cluster.core.topology import Place, check_nesting, group_ranks


def _at(*pairs: tuple[str, str]) -> list[Place]:
    """Ranks at (host, DEST): one machine per host name, one directory per DEST path."""
    return [Place(host, directory=dest, within=dest, dest=dest) for host, dest in pairs]


def test_one_rank_per_node_is_everyone_leader_and_downloader() -> None:
    topo = group_ranks(_at(("a", "/d"), ("b", "/d"), ("c", "/d")))
    assert topo.group_of == (0, 1, 2) and topo.leaders == (0, 1, 2)
    assert topo.downloaders == (0, 1, 2) and topo.hosts == 3 and topo.groups == 3
    assert all(topo.is_leader(r) for r in range(3))


def test_same_host_same_dest_is_one_group_with_one_leader() -> None:
    topo = group_ranks(_at(*[("n1", "/nvme")] * 4))
    assert topo.groups == 1 and topo.leaders == (0,) and topo.hosts == 1
    assert [topo.is_leader(r) for r in range(4)] == [True, False, False, False]
    assert topo.downloaders == (0, 1, 2, 3)


def test_rank_placeholder_makes_one_group_per_rank_on_one_host() -> None:
    topo = group_ranks(_at(*[("n1", f"/x/{r}") for r in range(4)]))
    assert topo.groups == 4 and topo.hosts == 1 and topo.leaders == (0, 1, 2, 3)


def test_block_placement_two_nodes_of_four() -> None:
    places = _at(*[("n1", "/d")] * 4, *[("n2", "/d")] * 4)
    topo = group_ranks(places)
    assert topo.leaders == (0, 4) and topo.group_of == (0, 0, 0, 0, 1, 1, 1, 1)
    assert topo.members(1) == [4, 5, 6, 7] and topo.group_of[6] == 1
    # Downloaders round-robin over the nodes: leaders first, then each node's next rank.
    assert group_ranks(places, download_ranks=2).downloaders == (0, 4)
    assert group_ranks(places, download_ranks=3).downloaders == (0, 1, 4)
    assert group_ranks(places, download_ranks=100).downloaders == tuple(range(8))


def test_cyclic_placement() -> None:
    places = _at(*[("n1", "/d"), ("n2", "/d")] * 3)
    topo = group_ranks(places, download_ranks=4)
    assert topo.leaders == (0, 1) and topo.downloaders == (0, 1, 2, 3)


def test_reader_leads_its_group() -> None:
    topo = group_ranks(_at(*[("n1", "/d")] * 4), preferred_leader=2)
    assert topo.leaders == (2,) and topo.is_leader(2) and not topo.is_leader(0)
    # The reader's group's downloaders start with it.
    assert group_ranks(_at(*[("n1", "/d")] * 4), preferred_leader=2, download_ranks=1).downloaders == (2,)


@pytest.mark.parametrize(("reader", "k"), [(4, None), (-1, None), (None, 0), (None, -3)])
def test_bad_roles_are_usage_errors(reader: int | None, k: int | None) -> None:
    with pytest.raises(UsageError):
        group_ranks(_at(*[("n1", "/d")] * 4), preferred_leader=reader, download_ranks=k)


@given(
    pairs=st.lists(st.tuples(st.sampled_from("abc"), st.sampled_from(["/d", "/e"])), min_size=1, max_size=24),
    data=st.data(),
)
@settings(max_examples=200, deadline=None)
def test_roles_are_consistent(pairs: list[tuple[str, str]], data: st.DataObject) -> None:
    places = _at(*pairs)
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


def test_one_directory_by_two_paths_on_one_machine_is_one_node() -> None:
    # A bind mount, or two containers (host names of their own) mounting one host directory at
    # different places: one device and inode on one kernel.
    one = Place("pod-a", machine="boot1", directory="2049:77:", mount="8:1", within="/srv/nvme", dest="/mnt/a")
    places = [one, one._replace(dest="/data/b"), one._replace(host="pod-b", dest="/x")]
    topo = group_ranks(places)
    assert topo.groups == 1 and topo.leaders == (0,) and topo.hosts == 2
    check_nesting(places, topo.group_of)


def test_one_host_name_on_two_machines_is_two_nodes() -> None:
    # Containers started with one fixed --hostname on two machines: their boot ids tell them apart.
    a = Place("node", machine="boot1", directory="2049:77:", mount="8:1", within="/nvme", dest="/nvme")
    topo = group_ranks([a, a._replace(machine="boot2")])
    assert topo.groups == 2 and topo.hosts == 1
    # Without boot ids the host name stands in: one node, as before.
    assert group_ranks([a._replace(machine=""), a._replace(machine="")]).groups == 1


def _dests(*withins: str, machine: str = "boot1", mount: str = "8:1") -> list[Place]:
    return [
        Place("n1", machine=machine, directory=f"2049:{i}:", mount=mount, within=w, dest=f"/d/{i}")
        for i, w in enumerate(withins)
    ]


@pytest.mark.parametrize(
    ("withins", "inner", "outer"),
    [
        (("/scratch/a", "/scratch/a/sub"), 1, 0),
        (("/scratch/a/sub/deeper", "/scratch/a"), 0, 1),
        (("/x", "/y", "/", "/z"), 0, 2),  # a DEST at the filesystem's root holds every other
    ],
)
def test_a_dest_inside_another_nodes_dest_on_one_machine_is_refused(
    withins: tuple[str, ...], inner: int, outer: int
) -> None:
    places = _dests(*withins)
    topo = group_ranks(places)
    with pytest.raises(TopologyError) as caught:
        check_nesting(places, topo.group_of)
    error = caught.value
    assert error.rank == inner and error.path == f"/d/{inner}" and error.exit_code == 2
    assert f"inside rank {outer}'s DEST /d/{outer} on the same host" in error.message


def test_side_by_side_dests_and_other_filesystems_or_machines_are_not_nested() -> None:
    for places in (
        _dests("/scratch/a", "/scratch/ab", "/scratch/b"),  # a prefix of the name, not of the path
        _dests("/scratch/a")
        + _dests("/scratch/a/sub", mount="0:50"),  # another filesystem (a mount point inside: its own files)
        _dests("/scratch/a") + _dests("/scratch/a/sub", machine="boot2"),  # another machine
    ):
        check_nesting(places, group_ranks(places).group_of)


def test_one_path_in_one_filesystem_with_two_inodes_is_refused_too() -> None:
    a, b = _dests("/srv/x", "/srv/x")  # a mount over one of them since: not what it seems
    b = b._replace(host="n2")
    with pytest.raises(TopologyError, match="on the same machine \\(host n2\\), yet not by device and inode"):
        check_nesting([b, a], group_ranks([b, a]).group_of)


@given(
    withins=st.lists(st.sampled_from(["/a", "/a/b", "/a/b/c", "/ab", "/c", "/"]), min_size=1, max_size=8),
    machines=st.data(),
)
def test_nesting_is_refused_exactly_when_one_nodes_path_is_below_anothers(
    withins: list[str], machines: st.DataObject
) -> None:
    boots = machines.draw(st.lists(st.sampled_from(["m1", "m2"]), min_size=len(withins), max_size=len(withins)))
    places = [
        Place("h", machine=m, directory=f"{m}{w}", mount="8:1", within=w, dest=w)
        for m, w in zip(boots, withins, strict=True)
    ]

    def below(inner: str, outer: str) -> bool:
        return inner != outer and (outer == "/" or inner.startswith(outer + "/"))

    nested = any(p.machine == q.machine and below(p.within, q.within) for p in places for q in places)
    topo = group_ranks(places)
    if nested:
        with pytest.raises(TopologyError):
            check_nesting(places, topo.group_of)
    else:
        check_nesting(places, topo.group_of)
