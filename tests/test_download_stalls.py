"""The stall watchdog takes neither a slow disk nor a slow server for a stalled body.

Against the real emulator, in-process. The disk is made slow by delaying each write (a
fault the machine's disk cannot be asked for), longer than --read-timeout; the server, by
the fault proxy forwarding the body in small pieces with pauses.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from azcp_cluster.api import make_config
from azcp_cluster.azure.credentials import Authorizer, resolve_credential
from azcp_cluster.core.blocks import blocks_for
from azcp_cluster.core.config import Config, MiB
from azcp_cluster.core.model import FileEntry
from azcp_cluster.core.plan import Shard
from azcp_cluster.core.source import parse_blob_url
from azcp_cluster.dest.desttree import DestTree
from azcp_cluster.dest.directio import DirectFile
from azcp_cluster.dest.localfs import temp_path
from azcp_cluster.dest.nodewriter import NodeWriter
from azcp_cluster.devtools import azurite
from azcp_cluster.devtools.datasets import pseudo_random
from azcp_cluster.devtools.faultproxy import FaultProxy, Rule
from azcp_cluster.download.downloader import Downloader
from azcp_cluster.download.fetcher import DownloadStats
from azcp_cluster.download.writepool import WritePool

SIZE = 6 * MiB
# Each 2 MiB write takes WRITE_DELAY, twice as long as a body may stay silent (READ_TIMEOUT),
# which leaves the emulator's answer and the watchdog's looks room on a loaded machine.
WRITE_DELAY = 1.0
READ_TIMEOUT = 0.5


def _download_one(
    source: str,
    key_env: dict[str, str],
    dest: Path,
    name: str,
    size: int,
    options: dict[str, object],
    pool: Callable[[Config], WritePool] | None = None,
    threads: int | None = None,
) -> DownloadStats:
    """Download blob ``name`` (``size`` bytes) of the container at ``source`` into ``dest``'s temporary file."""
    parsed = parse_blob_url(source)
    auth = Authorizer(parsed, resolve_credential(parsed, key_env), time.time)
    cfg = make_config(source, str(dest), options)
    tree = DestTree(str(dest), create=True)
    tree.prepare(name, size)
    files = [FileEntry(name=name, path=name, size=size)]
    writes = pool(cfg) if pool is not None else None
    writer = NodeWriter(files, tree, threads) if threads is not None else None
    try:
        downloader = Downloader(files, tree, auth, cfg, pool=writes, writer=writer)
        return downloader.run(blocks_for([Shard(0, 0, size, 0)], cfg.block_size))
    finally:
        if writer is not None:
            writer.close()


def test_requests_waiting_for_a_slow_disk_are_not_aborted_as_stalled(
    emulator: azurite.Emulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    container = "s" + uuid.uuid4().hex[:20]
    data = pseudo_random(SIZE, container)
    azurite.upload(emulator, container, {"big.bin": data})
    real_write = DirectFile.write_at

    def slow_write(self: DirectFile, data: np.ndarray, offset: int) -> int:
        time.sleep(WRITE_DELAY)
        return real_write(self, data, offset)

    monkeypatch.setattr(DirectFile, "write_at", slow_write)
    started = time.monotonic()
    # One 2 MiB buffer and one writer: in the middle of the body the request waits a whole
    # write for the buffer to come back, twice, while its connection sends nothing.
    stats = _download_one(
        emulator.url(container),
        emulator.key_env(),
        tmp_path,
        "big.bin",
        SIZE,
        {"block_size": 6 * MiB, "concurrency": 1, "read_timeout": READ_TIMEOUT, "max_retries": 2},
        pool=lambda cfg: WritePool(cfg, buffers=1),
        threads=1,
    )
    assert time.monotonic() - started > 3 * WRITE_DELAY  # the disk set the pace
    assert stats.retries == 0, dict(stats.retry_causes)
    assert Path(temp_path(str(tmp_path), "big.bin")).read_bytes() == data


def _slow_body(
    emulator: azurite.Emulator, dest: Path, size: int, rule: Rule, read_timeout: float, retries: int
) -> DownloadStats:
    """One blob of ``size`` bytes downloaded through the fault proxy's ``rule`` (a ``slow`` body),
    one request in flight; checked byte for byte."""
    container = "t" + uuid.uuid4().hex[:20]
    data = pseudo_random(size, container)
    azurite.upload(emulator, container, {rule.blob: data})
    with FaultProxy(emulator, [rule]) as proxy:
        stats = _download_one(
            proxy.url(container),
            emulator.key_env(),
            dest,
            rule.blob,
            size,
            {"block_size": 2 * MiB, "concurrency": 1, "read_timeout": read_timeout, "max_retries": retries},
        )
        assert proxy.injected == 1
    assert Path(temp_path(str(dest), rule.blob)).read_bytes() == data
    return stats


def test_a_slow_but_live_body_is_not_taken_for_a_stall(emulator: azurite.Emulator, tmp_path: Path) -> None:
    """Bytes under the socket's low-water mark stay in the kernel, unseen: the watchdog's
    first quiet tick switches the body to trickle, and a slow server is not a stalled one.
    """
    size = 3 * MiB // 2  # more than the low-water mark: 1 MiB would take 1.6 s to gather here,
    rule = Rule("slow", blob="slow.bin", partial=32 * 1024, stall=0.05)  # at about 640 KiB/s,
    stats = _slow_body(emulator, tmp_path, size, rule, read_timeout=0.8, retries=0)  # twice the timeout
    assert stats.retries == 0, dict(stats.retry_causes)


def test_a_trickling_body_is_given_up_on_and_asked_again(emulator: azurite.Emulator, tmp_path: Path) -> None:
    """A body that is never quiet for the read timeout but brings 320 bytes a second (16 every
    0.05 s) is under the floor (retry.MIN_BODY_RATE) over a read timeout of waiting: dropped and
    asked again (cause "slow body"), where it used to hold the request for the whole body
    (some 100 s for these 32 KiB; hours for a 16 MiB block)."""
    started = time.monotonic()
    rule = Rule("slow", blob="trickle.bin", partial=16, stall=0.05)
    stats = _slow_body(emulator, tmp_path, 32 * 1024, rule, read_timeout=1.0, retries=2)
    assert dict(stats.retry_causes) == {"slow body": 1}
    assert time.monotonic() - started < 20


def test_the_pace_floor() -> None:
    from azcp_cluster.core.retry import MIN_BODY_RATE, too_slow

    assert too_slow(0, 1.0) and too_slow(MIN_BODY_RATE * 60 - 1, 60.0)
    assert not too_slow(MIN_BODY_RATE * 60, 60.0) and not too_slow(0, 0.0)
