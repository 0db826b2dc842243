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


CHECKPOINT_SMALL = 1600  # a checkpoint's small files: config, tokenizer, metadata, per-layer indices


def checkpoint(size: int, small: int = CHECKPOINT_SMALL, prefix: str = "") -> dict[str, bytes]:
    """``size`` bytes laid out as a real checkpoint is: one file with most of them and ``small``
    small ones (64 B to 4 KiB each, about 2 KiB on average: config, tokenizer, metadata), the small
    ones scaled down to at most a quarter of ``size`` where it is too small for them."""
    sizes = [64 + (i * 2654435761) % 4032 for i in range(small)]  # spread, reproducible
    room = size // 4
    if sum(sizes) > room:
        sizes = [n * room // sum(sizes) for n in sizes]
    names = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    names += [f"metadata/layer-{i:04d}.json" for i in range(small - len(names))]
    tree = {f"{prefix}{name}": pseudo_random(n, f"checkpoint-{name}") for name, n in zip(names, sizes, strict=False)}
    tree[f"{prefix}model.safetensors"] = pseudo_random(size - sum(len(d) for d in tree.values()), "checkpoint-model")
    return tree
