"""One ranged GET, several landings: a streamed copy's small blocks fetched in large requests.

Against the real emulator, in-process, with the fault proxy where a body must break. The
blocks (the landing units: journal records, streaming notices) land one by one, in order, as
their bytes are written, while their request's body goes on; a request broken after some of
them landed is asked again from the first that did not, and no block ever lands twice.
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from azcp_cluster.api import make_config
from azcp_cluster.azure.credentials import Authorizer, resolve_credential
from azcp_cluster.core.blocks import Block, blocks_for, deal_requests, fanout_slots, requests_for
from azcp_cluster.core.config import MiB
from azcp_cluster.core.model import FileEntry
from azcp_cluster.core.plan import Shard
from azcp_cluster.core.source import parse_blob_url
from azcp_cluster.dest.desttree import DestTree
from azcp_cluster.dest.directio import DirectFile
from azcp_cluster.dest.localfs import temp_path
from azcp_cluster.devtools import azurite
from azcp_cluster.devtools.datasets import pseudo_random
from azcp_cluster.devtools.faultproxy import FaultProxy, Rule
from azcp_cluster.download.downloader import Downloader
from azcp_cluster.download.fetcher import DownloadStats, LandingSink
from azcp_cluster.run.cluster import PeerFailed

# -- which blocks one request fetches (pure) -------------------------------------------------


def test_consecutive_blocks_of_a_file_share_a_request_up_to_its_size() -> None:
    blocks = [Block(0, 0, 4), Block(0, 4, 4), Block(0, 8, 2), Block(0, 10, 1), Block(0, 11, 1)]
    assert requests_for(blocks, 8) == [blocks[:2], blocks[2:]]
    assert requests_for(blocks, 4) == [[b] for b in blocks[:2]] + [blocks[2:]]


def test_a_gap_another_file_or_a_block_out_of_order_starts_a_new_request() -> None:
    gap = [Block(0, 0, 4), Block(0, 8, 4)]
    other = [Block(0, 0, 4), Block(1, 4, 4)]
    backwards = [Block(0, 4, 4), Block(0, 0, 4)]
    for blocks in (gap, other, backwards):
        assert requests_for(blocks, 100) == [[b] for b in blocks]


def test_full_size_blocks_stay_one_request_each() -> None:
    # Every copy that does not stream: its blocks are --block-size already.
    blocks = blocks_for([Shard(0, 0, 40 * MiB, 0), Shard(1, 0, 3, 0)], 16 * MiB)
    assert requests_for(blocks, 16 * MiB) == [[b] for b in blocks]


@given(
    st.lists(st.tuples(st.integers(0, 2), st.integers(1, 50)), max_size=40),
    st.integers(1, 120),
)
def test_requests_keep_every_block_in_order_and_fetch_contiguous_ranges(
    spans: list[tuple[int, int]], request_bytes: int
) -> None:
    blocks, ends = [], {0: 0, 1: 0, 2: 0}
    for file, length in spans:
        blocks.append(Block(file, ends[file], length))
        ends[file] += length
    requests = requests_for(blocks, request_bytes)
    assert [b for request in requests for b in request] == blocks
    for request in requests:
        assert len(request) == 1 or sum(b.length for b in request) <= request_bytes
        for a, b in itertools.pairwise(request):
            assert b.file == a.file and b.offset == a.offset + a.length


def test_fanout_slots_keep_the_memory_and_map_more_of_smaller_slots() -> None:
    assert fanout_slots(4, 16 * MiB, 16 * MiB, 100) == 4  # not streamed: as configured
    assert fanout_slots(4, 16 * MiB, 2 * MiB, 100) == 32  # streamed: 2 MiB slots in 64 MiB
    assert fanout_slots(4, 16 * MiB, 2 * MiB, 10) == 10  # never more than transfers
    assert fanout_slots(4, 16 * MiB, 64 * 1024, 10**6) == 64  # at most MAX_SLOTS
    assert fanout_slots(8, 16 * MiB, 64 * 1024, 10**6) == 64
    assert fanout_slots(100, 16 * MiB, 64 * 1024, 10**6) == 100  # never fewer than configured
    with pytest.raises(ValueError):
        fanout_slots(4, 16 * MiB, 0, 10)


# -- the downloader, against the emulator ------------------------------------------------


def _blob(emulator: azurite.Emulator, name: str, size: int) -> tuple[str, bytes]:
    """A new container holding blob ``name`` of ``size`` pseudo-random bytes: its name and the bytes."""
    container = "q" + uuid.uuid4().hex[:20]
    data = pseudo_random(size, container)
    azurite.upload(emulator, container, {name: data})
    return container, data


def _download(
    source: str, key_env: dict[str, str], dest: Path, name: str, size: int, unit: int, request: int
) -> tuple[DownloadStats, list[tuple[float, Block]]]:
    parsed = parse_blob_url(source)
    auth = Authorizer(parsed, resolve_credential(parsed, key_env), time.time)
    cfg = make_config(source, str(dest), {"block_size": request, "concurrency": 1, "max_retries": 3})
    tree = DestTree(str(dest), create=True)
    tree.prepare(name, size)
    files = [FileEntry(name=name, path=name, size=size)]
    landed: list[tuple[float, Block]] = []
    sink = LandingSink(notice=lambda block: landed.append((time.monotonic(), block)))
    downloader = Downloader(files, tree, auth, cfg, sink=sink)
    return downloader.run(blocks_for([Shard(0, 0, size, 0)], unit)), landed


def test_one_request_lands_its_blocks_one_by_one_as_the_body_goes_on(
    emulator: azurite.Emulator, tmp_path: Path
) -> None:
    size = 8 * MiB
    container, data = _blob(emulator, "w.bin", size)
    # The body comes 256 KiB every 20 ms (about 12 MiB/s): 8 MiB take 0.6 s, so blocks that
    # landed only at the request's end would all land within a few ms of each other.
    rules = [Rule("slow", blob="w.bin", partial=256 * 1024, stall=0.02)]
    with FaultProxy(emulator, rules) as proxy:
        stats, landed = _download(proxy.url(container), emulator.key_env(), tmp_path, "w.bin", size, MiB, size)
        gets = [seen for seen in proxy.log if seen.method == "GET" and seen.range]
    assert [seen.range for seen in gets] == [f"bytes=0-{size - 1}"]  # one request
    assert [block for _, block in landed] == blocks_for([Shard(0, 0, size, 0)], MiB)  # each, once, in order
    assert landed[-1][0] - landed[0][0] > 0.3, [round(t - landed[0][0], 3) for t, _ in landed]
    assert stats.bytes == size and stats.requests == 1
    assert Path(temp_path(str(tmp_path), "w.bin")).read_bytes() == data


def test_a_request_broken_midway_is_asked_again_from_its_first_block_not_landed(
    emulator: azurite.Emulator, tmp_path: Path
) -> None:
    size = 8 * MiB
    container, data = _blob(emulator, "b.bin", size)
    # Reset after 5.5 MiB of the first GET: blocks 0-4 (1 MiB each) are whole by then.
    rules = [Rule("reset", blob="b.bin", partial=5 * MiB + MiB // 2)]
    with FaultProxy(emulator, rules) as proxy:
        stats, landed = _download(proxy.url(container), emulator.key_env(), tmp_path, "b.bin", size, MiB, size)
        ranges = [seen.range for seen in proxy.log if seen.method == "GET" and seen.range]
        assert proxy.injected == 1
    blocks = [block for _, block in landed]
    assert blocks == blocks_for([Shard(0, 0, size, 0)], MiB)  # never one twice
    assert ranges[0] == f"bytes=0-{size - 1}"
    # Asked again from a block boundary at or after the last whole block before the reset.
    again = int(ranges[1].split("=")[1].split("-")[0])
    assert again % MiB == 0 and 4 * MiB <= again <= 5 * MiB, ranges
    assert stats.retries == 1 and stats.bytes == size
    assert Path(temp_path(str(tmp_path), "b.bin")).read_bytes() == data


def test_workers_are_dealt_whole_requests_so_consecutive_blocks_stay_one_get() -> None:
    # 16 streamed 2 MiB blocks of one file over 4 worker processes: 4 GETs of 8 MiB, not 16 of 2.
    blocks = blocks_for([Shard(0, 0, 32 * MiB, 0)], 2 * MiB)
    parts = deal_requests(blocks, 4, 8 * MiB)
    assert sorted((b for part in parts for b in part), key=lambda b: b.offset) == blocks
    assert [len(requests_for(part, 8 * MiB)) for part in parts] == [1, 1, 1, 1]
    assert deal_requests([], 3, MiB) == [[], [], []]


def test_a_download_stopped_while_its_writes_are_slow_leaves_no_file_open(
    emulator: azurite.Emulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another rank fails while this request waits for its blocks' writes: the request is
    # cancelled there, and its file must still be closed (by the last write).
    size = 4 * MiB
    container, _ = _blob(emulator, "s.bin", size)
    real_write = DirectFile.write_at

    def slow_write(self: DirectFile, data: np.ndarray, offset: int) -> int:
        time.sleep(1.0)
        return real_write(self, data, offset)

    monkeypatch.setattr(DirectFile, "write_at", slow_write)
    parsed = parse_blob_url(emulator.url(container))
    auth = Authorizer(parsed, resolve_credential(parsed, emulator.key_env()), time.time)
    cfg = make_config(emulator.url(container), str(tmp_path), {"block_size": size, "concurrency": 1})
    tree = DestTree(str(tmp_path), create=True)
    tree.prepare("s.bin", size)
    started = time.monotonic()
    downloader = Downloader(
        [FileEntry(name="s.bin", path="s.bin", size=size)], tree, auth, cfg,
        peer_failed=lambda: time.monotonic() - started > 0.3,
    )  # fmt: skip
    with pytest.raises(PeerFailed):
        downloader.run(blocks_for([Shard(0, 0, size, 0)], MiB))
    temp = temp_path(str(tmp_path), "s.bin")
    still_open = [fd for fd in os.listdir("/proc/self/fd") if _points_to(fd, temp)]
    assert still_open == []


def _points_to(fd: str, path: str) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == path
    except OSError:
        return False
