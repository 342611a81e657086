"""Checkpoint files checked while they are read: one pass over the bytes, not a verification pass and then a read.

``load_state`` checks up front only what costs nothing (every file of the manifest exists and has its size:
``layout.verify(checksums=False)`` on the leader) and the checksums of files no impel reader reads (DeepSpeed's
engine files, a hook's files). On every rank, ``load_state`` builds the checkpoint's :class:`Manifest` and passes
it down, explicitly, to the strategy and every reader (``files.read_torch``, ``files.read_safetensors``, the DCP
reader in ``sharded``): each takes it as its first, required parameter (``None``: a file outside a checkpoint,
read unchecked) and opens a manifest file through :func:`open_checked`: a
:class:`VerifyingReader` hashes each byte right after the read put it into its destination (the tensor's own
memory), and when the reader is done compares the block digests with the manifest's and raises the manifest's
``CheckpointError`` naming the file and the byte range. A parse error in a corrupted file surfaces as that
corruption, not as the parser's complaint. Reads that continue the hashed prefix are hashed as they arrive; what
the reader read out of order, skipped or re-read is hashed from the file (by then in the page cache) when it is
done, so every byte is hashed exactly once and read from disk once (``torch.load`` reads the zip's directory at
the end first, and the records in the order it unpickles them). A failed check raises after earlier objects were
loaded: the error names the damaged file, and the way out is an earlier checkpoint, as for any failed load.
"""
from __future__ import annotations

import bisect
import io
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from impel.checkpoint import formats
from impel.checkpoint.io import hashing
from impel.checkpoint.store.layout import CheckpointError, corrupted, entry_blocks, entry_ends, missing_file

# Bytes a reader asks the kernel for ahead of its position (posix_fadvise WILLNEED), within the ranges it will
# read: a cold read otherwise waits for each request in turn while the disk idles as the caller copies and hashes.
# Measured on the development VM, 600 MB read cold in 1.3 MB reads (a tensor at a time), 4 rounds each: 0.60 GB/s
# without, 0.98 with 32 MiB asked ahead (1.04 with 128 MiB), the kernel's own readahead being 8 MiB.
AHEAD = 32 << 20
_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", None)  # None where the platform has no posix_fadvise (macOS)

# files impel's readers open through open_checked (the leader checks the others' checksums up front): the formats'
_READ_CHECKED = formats.read_checked_pattern()


def checked_on_read(rel: str) -> bool:
    """True for a manifest path (relative, posix) that impel's readers verify while reading it."""
    return _READ_CHECKED.match(rel) is not None


@dataclass(frozen=True)
class Manifest:
    """A checkpoint's manifest, as its readers check files against it (``load_state`` passes it down)."""
    directory: Path
    files: dict[str, dict[str, Any]]
    block: int

    @classmethod
    def of(cls, directory: Path, metadata: dict[str, Any]) -> Manifest:
        """``directory``'s manifest from its metadata (``layout.read_metadata``)."""
        return cls(Path(directory).absolute(), dict(metadata.get("files", {})),
                   int(metadata.get("block_size") or hashing.BLOCK))

    def entry(self, path: Path) -> tuple[dict[str, Any], int] | None:
        """``path``'s manifest entry and the block size, or None for a file the manifest does not list."""
        try:
            rel = Path(path).absolute().relative_to(self.directory).as_posix()
        except ValueError:
            return None
        entry = self.files.get(rel)
        return (entry, self.block) if entry is not None else None


class VerifyingReader(io.RawIOBase):
    """A read-only, seekable view of a file that hashes every byte once as the caller reads it; :meth:`check`
    compares with the manifest entry (format 3 or 2: per block; format 1: the whole file's sha256)."""

    def __init__(self, path: Path, entry: dict[str, Any], block: int) -> None:
        super().__init__()
        self.path, self.entry = path, entry
        found = entry_blocks(entry)
        self.block = block if found is not None else max(1, int(entry["size"]))
        self.key = found[0] if found is not None else "sha256_blocks"
        self.expected = found[1] if found is not None else []  # the manifest's block digests (format 2 on)
        self.ends = entry_ends(entry)
        self.hasher = hashing.BlockHasher(self.block, self.key, self.ends)
        self.touched: dict[int, Any] | None = None  # verify_touched_only: block -> [next offset, hasher] or a note
        self.checked: list[int] = []
        self.raw = open(path, "rb", buffering=0)  # noqa: SIM115 - closed in close()
        self.size = os.fstat(self.raw.fileno()).st_size
        self.position = 0
        self.hashed = 0  # bytes [0, hashed) went through the hasher
        self.planned: list[tuple[int, int]] | None = None  # the byte ranges the caller will read (None: any)
        self._window = (0, 0)  # [start, end): the bytes asked of the kernel ahead of the reader

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence]
        self.position = base + offset
        return self.position

    def plan(self, ranges: list[tuple[int, int]]) -> None:
        """The byte ranges [start, end) the caller will read (a rank reading its shards of a full file): what is
        asked ahead of the reads stays within them."""
        merged: list[tuple[int, int]] = []
        for start, end in sorted(ranges):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        self.planned = merged

    def _ask_ahead(self) -> None:
        """Ask the kernel for the next AHEAD bytes the caller will read, half a window at a time; a reader that
        jumped (a zip's directory at the end first, then its records from the start) starts a new window."""
        if _WILLNEED is None:
            return
        start, end = self._window
        if not start <= self.position <= end:
            start = end = self.position
        if end - self.position < AHEAD // 2:
            until = min(self.position + AHEAD, self.size)
            for lo, hi in [(end, until)] if self.planned is None else self.planned:
                lo, hi = max(lo, end), min(hi, until)
                if hi <= lo:
                    continue
                try:
                    os.posix_fadvise(self.raw.fileno(), lo, hi - lo, _WILLNEED)
                except OSError:  # a hint: a file system that refuses it reads as before
                    break
            end = max(end, until)
        self._window = (start, end)

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        self._ask_ahead()
        n = self.raw.readinto(view) if self.raw.tell() == self.position else self._pread_into(view)
        n = n or 0
        self._hash(self.position, view[:n])
        self.position += n
        return n

    def _pread_into(self, view: memoryview) -> int:
        self.raw.seek(self.position)
        return self.raw.readinto(view) or 0

    def _hash(self, start: int, data: memoryview) -> None:
        if self.touched is not None:
            self._hash_touched(start, data)
            return
        # only a read that continues the hashed prefix is hashed now (a zip reader reads its directory at the end
        # first: hashing the gap up to there would read the whole file ahead of the reader); the rest at check()
        if start <= self.hashed < start + data.nbytes:
            self.hasher.update(data[self.hashed - start:])
            self.hashed = start + data.nbytes

    def verify_touched_only(self) -> bool:
        """For a reader that reads a part of a file several ranks wrote (``full_slices``): check only the blocks
        it reads; True when the entry allows it (one block per range a rank wrote, format 4: a rank loading on the
        saving layout reads exactly its own blocks, so every block is checked by the rank that reads it and the
        file is read once in all, not once per rank). A damaged block no rank reads holds no value anybody loads;
        the rank that reads a damaged one fails, and ``load_state`` fails every rank with it."""
        if self.ends is None:
            return False
        self.touched = {}
        return True

    def hash_up_to(self, position: int) -> None:
        """Hash the bytes before ``position`` the caller skips, now, from the file (a reader that reads forward
        with gaps, ``full_slices``: the file is then read front to back once, as the kernel reads ahead)."""
        if position > self.hashed:
            self._hash_from_file(min(position, self.size))

    def _hash_from_file(self, end: int) -> None:
        buffer = bytearray(min(8 << 20, max(1, end - self.hashed)))
        fd = self.raw.fileno()
        while self.hashed < end:
            n = os.preadv(fd, [memoryview(buffer)[:min(len(buffer), end - self.hashed)]], self.hashed)
            if not n:
                break
            self.hasher.update(memoryview(buffer)[:n])
            self.hashed += n

    def _hash_touched(self, start: int, data: memoryview) -> None:
        """Feed each block the read overlaps: a block read front to back is hashed as it arrives; one read out of
        order is hashed from the file at :meth:`check`."""
        assert self.ends is not None and self.touched is not None
        end = start + data.nbytes
        index = bisect.bisect_right(self.ends, start)
        while index < len(self.ends) and (index == 0 or self.ends[index - 1] < end):
            lo, hi = (self.ends[index - 1] if index else 0), self.ends[index]
            part = data[max(lo, start) - start:min(hi, end) - start]
            state = self.touched.get(index)
            if state is None and max(lo, start) == lo:
                state = self.touched[index] = [lo, hashing.KEYS[self.key]()]
            elif state is None or isinstance(state, str) or state[0] != max(lo, start):
                self.touched[index] = "from file"
                index += 1
                continue
            state[1].update(part)
            state[0] += part.nbytes
            index += 1

    def _touched_digests(self) -> tuple[list[str], list[str]]:
        """(expected, got) for the blocks this reader touched."""
        assert self.ends is not None and self.touched is not None
        expected, got = [], []
        for index, state in sorted(self.touched.items()):
            hi = self.ends[index]
            if isinstance(state, list) and state[0] == hi:
                digest = state[1].hexdigest()
            else:
                digest = hashing.block_digest(self.path, index, key=self.key, ends=self.ends)
            expected.append(self.expected[index])
            got.append(digest)
            self.checked.append(index)
        return expected, got

    def check(self) -> None:
        """Hash what the caller never read, then raise the manifest's error if any block differs."""
        if self.touched is None:
            self._hash_from_file(self.size)
        if self.size != self.entry["size"]:
            raise CheckpointError(f"checkpoint file {self.path} is truncated or corrupted ({self.size} bytes, the "
                                  f"manifest says {self.entry['size']} bytes); load an earlier checkpoint")
        if self.touched is not None:
            expected, got = self._touched_digests()
            bad = hashing.first_bad_block(expected, got)
            if bad is not None:
                raise corrupted(self.path, self.entry, self.checked[bad], self.block)
            return
        got = self.hasher.finish()
        found = entry_blocks(self.entry)
        if found is None:
            if got != [self.entry["sha256"]]:
                raise CheckpointError(f"checkpoint file {self.path} is corrupted (its sha256 differs from the "
                                      f"manifest's {self.entry['sha256'][:12]}...); load an earlier checkpoint")
            return
        bad = hashing.first_bad_block(found[1], got)
        if bad is not None:
            raise corrupted(self.path, self.entry, bad, self.block)

    def close(self) -> None:
        if not self.closed:
            self.raw.close()
        super().close()


@contextmanager
def open_checked(manifest: Manifest | None, path: Path) -> Iterator[Any]:
    """``path`` opened for reading; listed in ``manifest``, a :class:`VerifyingReader` checked when the block ends
    (a failure inside the block that the file's corruption explains raises as that corruption)."""
    found = manifest.entry(Path(path)) if manifest is not None else None
    if found is None:
        with open(path, "rb") as f:
            yield f
        return
    if not Path(path).is_file():
        raise missing_file(Path(path))
    reader = VerifyingReader(Path(path), *found)
    try:
        try:
            yield reader
        except Exception:
            reader.check()  # raises the corruption instead when there is one
            raise
        reader.check()
    finally:
        reader.close()


def read_all(manifest: Manifest | None, path: Path) -> bytes:
    """The whole file, verified against ``manifest`` (one read)."""
    with open_checked(manifest, path) as f:
        data: bytes = f.read()
    return data
