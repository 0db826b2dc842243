"""--verify's verdict (azcp_cluster/core/digests.py): which copies are compared, against what."""

from __future__ import annotations

import pytest

from azcp_cluster.core.digests import against_source, verdict
from azcp_cluster.core.errors import VerifyError
from azcp_cluster.core.model import FileEntry

A, B = "QUFBQUFBQUFBQUFBQUFBQQ==", "QkJCQkJCQkJCQkJCQkJCQg=="


def _files(*md5: str) -> list[FileEntry]:
    return [FileEntry(name=f"f{i}", path=f"f{i}", size=1, content_md5=m) for i, m in enumerate(md5)]


def test_every_copy_matches_the_content_md5() -> None:
    assert verdict(_files(A, B), [(0, {0: A, 1: B}), (2, {0: A, 1: B})]) == {0: A, 1: B}


def test_a_copy_that_differs_from_the_content_md5_names_its_rank_even_if_most_agree() -> None:
    with pytest.raises(VerifyError, match=r"rank\(s\) 0, 2 differs from the blob's Content-MD5") as err:
        verdict(_files(A), [(0, {0: B}), (1, {0: A}), (2, {0: B})])
    assert err.value.path == "f0"


def test_without_content_md5_the_majority_is_expected() -> None:
    assert verdict(_files(""), [(0, {0: A}), (1, {0: A})]) == {0: A}
    with pytest.raises(VerifyError, match=r"rank\(s\) 3 differs from the other ranks"):
        verdict(_files(""), [(0, {0: A}), (1, {0: A}), (3, {0: B})])


def test_only_the_nodes_that_hold_a_file_are_compared() -> None:
    """A subset of receivers: file 1 is on rank 2's node only; file 2 on nobody's."""
    got = verdict(_files("", "", ""), [(0, {0: A}), (2, {0: A, 1: B})])
    assert got == {0: A, 1: B}


def test_every_copy_is_checked_against_the_source_crc_where_it_is_known() -> None:
    files = [FileEntry("a", "a", 10), FileEntry("b", "b", 20), FileEntry("c", "c", 30)]
    source = {0: 111, 1: 222}  # c: its pieces did not tile it, nothing to check against
    same = [(0, {0: 111, 1: 222, 2: 5}), (4, {0: 111, 2: 6})]  # rank 4 does not hold b
    assert against_source(files, same, source) == 2
    assert against_source(files, [(0, {2: 1})], source) == 0  # only c held: nothing checked
    for bad in ([(0, {0: 111, 1: 223}), (4, {1: 223})], [(0, {0: 112}), (4, {0: 111})]):
        with pytest.raises(VerifyError, match="as they came from the source") as caught:
            against_source(files, bad, source)
        assert caught.value.path in ("a", "b")
    with pytest.raises(VerifyError, match=r"rank\(s\) 0, 4 differs"):
        against_source(files, [(0, {0: 1}), (4, {0: 2})], source)  # every copy the same, all wrong: still found


def test_a_file_whose_source_pieces_disagree_fails_where_a_node_holds_it() -> None:
    files = [FileEntry("a", "a", 10), FileEntry("b", "b", 20)]
    assert against_source(files, [(0, {1: 5})], {}, conflicting={0}) == 0  # nobody holds a: nothing to say
    with pytest.raises(VerifyError, match="disagree") as caught:
        against_source(files, [(0, {0: 1, 1: 5})], {1: 5}, conflicting={0})
    assert caught.value.path == "a"
