"""The manifest's checksums: XXH3-128 of every 64 MiB block of a file (format version 3).

XXH3 runs at memory speed (~27 GB/s on one core of the development machine, where sha256 runs at 2 GB/s: the
choice and its measurements are in docs/design.md), so it is computed inline, on the bytes as they are written
(:class:`BlockHasher` fed by the writers) and as they are read (``verified``), never in a pass of its own. Per-block
digests name the byte range that changed. Manifests of earlier versions keep verifying: version 2 has sha256 per
block (``sha256_blocks``), version 1 one sha256 per file (``sha256``). A block can be checked by hand::

    dd if=FILE bs=64M skip=N count=1 | xxh128sum      # (sha256sum for format version 2)
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import xxhash

BLOCK = 64 << 20
ALGORITHM = "xxh3_128"
_READ = 8 << 20
# manifest entry key -> hash constructor; the first is the one written now
KEYS: dict[str, Callable[[], Any]] = {"xxh3_128_blocks": xxhash.xxh3_128, "sha256_blocks": hashlib.sha256}
WRITTEN_KEY = "xxh3_128_blocks"


class BlockHasher:
    """Digests of consecutive blocks of a stream fed in pieces of any size: blocks of ``block`` bytes, or blocks
    ending at the given offsets (``ends``, ascending; a file written by several ranks has one block per run a rank
    wrote, hashed by that rank from memory: ``cooperative``)."""

    def __init__(self, block: int | None = None, key: str = WRITTEN_KEY, ends: list[int] | None = None) -> None:
        self.block = block or BLOCK
        self.ends = ends
        self._new = KEYS[key]
        self._current = self._new()
        self._filled = 0
        self._start = 0  # stream offset of the current block's first byte
        self.digests: list[str] = []

    def _length(self) -> int:
        """Bytes of the current block (the last of ``ends`` extends to the end of the stream)."""
        if self.ends is None:
            return self.block
        index = len(self.digests)
        return self.ends[index] - self._start if index < len(self.ends) else 1 << 62

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            length = self._length()
            take = min(view.nbytes, length - self._filled)
            self._current.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == length:
                self._close_block()

    def _close_block(self) -> None:
        self.digests.append(self._current.hexdigest())
        self._start += self._filled
        self._current, self._filled = self._new(), 0

    def finish(self) -> list[str]:
        """All digests; the last (partial) block's too, and one digest of no bytes for an empty stream."""
        if self._filled or not self.digests:
            self._close_block()
        return self.digests


def block_range(index: int, size: int, block: int | None = None, ends: list[int] | None = None) -> tuple[int, int]:
    """The byte range [start, end) of block ``index`` of a ``size``-byte file."""
    if ends is not None:
        return (ends[index - 1] if index else 0), min(ends[index], size)
    block = block or BLOCK
    return index * block, min((index + 1) * block, size)


def block_digest(path: Path, index: int, block: int | None = None, key: str = WRITTEN_KEY,
                 ends: list[int] | None = None) -> str:
    """The digest of block ``index`` of a file, read back (files not hashed while written: see ``digests``)."""
    start, stop = block_range(index, 1 << 62, block, ends)
    hasher = BlockHasher(1 << 62, key)  # one block: the range
    buffer = bytearray(min(_READ, max(1, stop - start)))
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        left = stop - start
        while left:
            n = f.readinto(view[:min(len(buffer), left)])
            if not n:
                break
            hasher.update(view[:n])
            left -= n
    return hasher.finish()[0]


def block_count(size: int, block: int | None = None, ends: list[int] | None = None) -> int:
    """Blocks of a ``size``-byte file; an empty file has one (the digest of no bytes)."""
    if ends is not None:
        return len(ends)
    return max(1, -(-size // (block or BLOCK)))


def workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def whole_file_digest(path: Path) -> str:
    """sha256 of the whole file (manifests of format version 1)."""
    return block_digest(path, 0, block=max(1, path.stat().st_size), key="sha256_blocks")


def digest_blocks(units: list[tuple[Path, int]], block: int | None = None, key: str = WRITTEN_KEY,
                  ends: dict[Path, list[int]] | None = None) -> list[str]:
    """The digests of ``(file, block index)`` units, in order, on a thread per core (the hashes release the GIL).
    ``ends``: files whose blocks end at the given offsets (the others have blocks of ``block`` bytes)."""
    ends = ends or {}

    def one(unit: tuple[Path, int]) -> str:
        return block_digest(unit[0], unit[1], block, key, ends.get(unit[0]))

    if len(units) < 2:
        return [one(unit) for unit in units]
    with ThreadPoolExecutor(max_workers=min(len(units), workers()), thread_name_prefix="impel-hash") as pool:
        return list(pool.map(one, units))


def file_digests(paths: list[Path], block: int | None = None, key: str = WRITTEN_KEY,
                 ends: dict[Path, list[int]] | None = None) -> list[list[str]]:
    """The block digests of each file (in order), every block of every file on its own thread."""
    ends = ends or {}
    counts = [block_count(path.stat().st_size, block, ends.get(path)) for path in paths]
    results = digest_blocks([(path, i) for path, n in zip(paths, counts) for i in range(n)], block, key, ends)
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
