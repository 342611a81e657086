"""The manifest's checksums: sha256 of every 64 MiB block of a file, hashed on all cores.

One sha256 over a whole file runs on one core at ~1.4 GB/s, as slow as the disk; per-block digests hash a large
file on every core at once, and a mismatch names the byte range that changed. Each block can be checked by hand::

    dd if=FILE bs=64M skip=N count=1 | sha256sum
"""
from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BLOCK = 64 << 20
_READ = 4 << 20


def block_digest(path: Path, index: int, block: int | None = None) -> str:
    block = block or BLOCK
    digest = hashlib.sha256()
    buffer = bytearray(_READ)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        f.seek(index * block)
        left = block
        while left:
            n = f.readinto(view[:min(_READ, left)])
            if not n:
                break
            digest.update(view[:n])  # hashlib releases the GIL for large updates: blocks hash in parallel
            left -= n
    return digest.hexdigest()


def block_count(size: int, block: int | None = None) -> int:
    """Blocks of a ``size``-byte file; an empty file has one (the digest of no bytes)."""
    return max(1, -(-size // (block or BLOCK)))


def workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def whole_file_digest(path: Path) -> str:
    """sha256 of the whole file (manifests of format version 1)."""
    return block_digest(path, 0, block=max(1, path.stat().st_size))


def digest_blocks(units: list[tuple[Path, int]], block: int | None = None) -> list[str]:
    """The digests of ``(file, block index)`` units, in order, on a thread per core (hashlib releases the GIL)."""
    if len(units) < 2:
        return [block_digest(path, i, block) for path, i in units]
    with ThreadPoolExecutor(max_workers=min(len(units), workers()), thread_name_prefix="impel-hash") as pool:
        return list(pool.map(lambda unit: block_digest(unit[0], unit[1], block), units))


def file_digests(paths: list[Path], block: int | None = None) -> list[list[str]]:
    """The block digests of each file (in order), every block of every file on its own thread."""
    counts = [block_count(path.stat().st_size, block) for path in paths]
    results = digest_blocks([(path, i) for path, n in zip(paths, counts) for i in range(n)], block)
    out: list[list[str]] = []
    at = 0
    for n in counts:
        out.append(results[at:at + n])
        at += n
    return out


def first_bad_block(expected: list[str], got: list[str]) -> int | None:
    """Index of the first block whose digest differs, None when all agree."""
    for i, (want, have) in enumerate(zip(expected, got)):
        if want != have:
            return i
    return None if len(expected) == len(got) else min(len(expected), len(got))
