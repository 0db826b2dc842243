"""Deterministic test datasets with the cases that break copy tools."""

from __future__ import annotations

import hashlib

from azcp_cluster.core.config import KiB, MiB


def pseudo_random(n: int, seed: str) -> bytes:
    """``n`` reproducible, incompressible bytes (SHAKE-256 of the seed)."""
    return hashlib.shake_256(seed.encode()).digest(n) if n else b""


def tricky_tree(prefix: str = "ckpt", chunk: int = 1 * MiB, block: int = 4 * MiB) -> dict[str, bytes]:
    """Blob name -> content: empty file, 4 KiB edges, chunk and block edges, nested,
    unicode and spaced names, many small files. Directory markers and a sibling prefix
    are added by :func:`with_traps`.
    """
    sizes = {
        "empty.bin": 0,
        "one.bin": 1,
        "page-minus.bin": 4 * KiB - 1,
        "page.bin": 4 * KiB,
        "page-plus.bin": 4 * KiB + 1,
        "chunk-minus.bin": chunk - 1,
        "chunk.bin": chunk,
        "chunk-plus.bin": chunk + 1,
        "block-plus.bin": block + 1,
        "nested/deeper/still/leaf.bin": 3 * KiB + 5,
        "unicodé/日本語 ファイル.txt": 777,
        "with space/a file (1).txt": 1234,
    }
    tree = {f"{prefix}/{name}": pseudo_random(size, name) for name, size in sizes.items()}
    for i in range(40):
        tree[f"{prefix}/small/part-{i:04d}.json"] = pseudo_random(100 + 37 * i, f"small{i}")
    return tree


def with_traps(tree: dict[str, bytes], prefix: str = "ckpt") -> dict[str, bytes]:
    """Add what must NOT be copied: a sibling prefix and directory-marker blobs."""
    traps = dict(tree)
    traps[f"{prefix}-other/should-not-copy.bin"] = b"sibling prefix"
    traps[f"{prefix}x.bin"] = b"sibling name"
    traps[f"{prefix}/nested/"] = b""  # directory marker
    return traps
