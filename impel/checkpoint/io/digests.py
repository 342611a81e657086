"""Checksums for the manifest, computed while the checkpoint is being written instead of after it.

* :class:`Sealer` and :func:`appending`: files written front to back (``torch.save``'s, DCP's shards, impel's
  safetensors files) go through an append-only file object that hashes the bytes as they pass (XXH3 runs at
  memory speed: no pass of its own) and writes them around the page cache on an I/O thread while later bytes are
  still being serialized (``direct_io``).
* :func:`finish_ranges`: a file several ranks write at once (``cooperative``: the full files of FSDP
  FULL_STATE_DICT) gets one block per byte range a rank wrote, hashed by that rank from memory; :func:`join_ranges`
  puts the ranks' ranges together.
* :func:`share_digests`: files nobody hashed yet (DCP's metadata, DeepSpeed's engine files, files of a
  ``register_save_state_pre_hook``) have their blocks dealt round-robin to the ranks.

The committing rank receives every digest and only hashes what is still unknown (see ``layout.build_manifest``).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from impel.checkpoint.io import hashing
from impel.checkpoint.io.direct_io import DirectFile
from impel.checkpoint.store.layout import (
    MARKER_FILE,
    METADATA_FILE,
    CheckpointError,
    fsync_file,
    manifest_entry,
)
from impel.runtime.ranks.collectives import is_distributed

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.checkpoint.metadata import Metadata

Entry = dict[str, Any]  # layout.manifest_entry: {"size": int, "xxh3_128_blocks": [str, ...]}
RANGES_KEY = "ranges"  # a rank's part of an entry (finish_ranges): [[start, end, digest], ...]


class Sealer:
    """Collects the digests of the files written under ``root`` (hashed as they were written) and fsyncs them on
    I/O threads; :meth:`entries` waits for all of it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        # several at once: fsyncs of different files overlap and share the filesystem's journal commits
        self._sync_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="impel-fsync")
        # file -> (its entry: a manifest entry, or this rank's byte ranges of a file several ranks wrote, see
        # ``finish_ranges``; its write finishing and fsync)
        self._pending: dict[str, tuple[Entry, Future[None]]] = {}
        self.parts: dict[str, Metadata] = {}  # files the committer writes from every rank's part (``contribute``)

    def relative(self, path: Path) -> str | None:
        try:
            return Path(path).absolute().relative_to(self.root).as_posix()
        except ValueError:
            return None

    def add(self, rel: str, entry: Entry, synced: Future[None]) -> None:
        self._pending[rel] = (entry, synced)

    def wait(self, rel: str) -> None:
        """Until the file ``rel`` (if queued) is written and fsynced; raises what its write raised."""
        if rel in self._pending:
            self._pending[rel][1].result()

    def sync(self, fn: Callable[..., None], *args: object) -> Future[None]:
        return self._sync_pool.submit(fn, *args)

    def entries(self) -> dict[str, Entry]:
        """Every queued file's entry (relative posix path -> manifest entry, or this rank's ranges of a shared file:
        ``join_ranges`` makes those entries) once all are written; raises what a write or fsync raised."""
        for _, synced in self._pending.values():
            synced.result()
        return {rel: entry for rel, (entry, _) in self._pending.items()}

    def close(self) -> None:
        self._sync_pool.shutdown(wait=True)


def _sealing(path: Path, sealer: Sealer | None) -> tuple[Sealer, str] | tuple[None, None]:
    """``sealer`` and ``path`` relative to its directory, or (None, None) without one or outside its directory."""
    rel = sealer.relative(path) if sealer is not None else None
    return (sealer, rel) if sealer is not None and rel is not None else (None, None)


def finish_ranges(file: DirectFile, size: int, ranges: list[tuple[int, int, str]], sealer: Sealer | None) -> None:
    """This rank's writes into the shared ``size``-byte file ``file`` are queued: with a :class:`Sealer` (the save's)
    its byte ranges (start, end, digest; hashed as written) are recorded, :func:`share_digests` joins every rank's
    into the file's entry, and the file is finished (the writes in flight, fsync) on an I/O thread while the save
    goes on, :meth:`Sealer.entries` waiting for it. Without one (or outside its directory) the file is finished
    now and hashed when the manifest is built."""
    sealer, rel = _sealing(file.path, sealer)
    if sealer is None or rel is None:
        file.finish()
        return
    sealer.add(rel, {"size": size, RANGES_KEY: [list(r) for r in ranges]}, sealer.sync(file.finish))


def join_ranges(known: list[dict[str, Entry]]) -> dict[str, Entry]:
    """Every rank's entries in one dict; the ranges ranks recorded of one file (:func:`finish_ranges`) become its
    entry with one block per range when together they cover the file exactly (else the file is left out: hashed
    from disk later)."""
    merged: dict[str, Entry] = {}
    pieces: dict[str, list[Any]] = {}
    sizes: dict[str, int] = {}
    for entries in known:
        for rel, entry in entries.items():
            if RANGES_KEY in entry:
                pieces.setdefault(rel, []).extend(entry[RANGES_KEY])
                sizes[rel] = entry["size"]
            else:
                merged[rel] = entry
    for rel, ranges in pieces.items():
        ranges.sort()
        ends = [end for _, end, _ in ranges]
        starts = [start for start, _, _ in ranges]
        if starts == [0, *ends[:-1]] and ends[-1] == sizes[rel]:
            merged[rel] = manifest_entry(sizes[rel], [digest for _, _, digest in ranges], ends)
    return merged


def settle(path: Path, sealer: Sealer | None) -> None:
    """With ``sealer`` (the save's): wait until ``path``, if this save wrote it, is wholly on disk (a file is
    finished in the background after its writer returns; a read-back of it waits here)."""
    sealer, rel = _sealing(path, sealer)
    if sealer is not None and rel is not None:
        sealer.wait(rel)


def contribute(path: Path, part: Metadata, sealer: Sealer | None) -> bool:
    """With ``sealer`` (the save's): this rank's ``part`` of the file ``path`` (a DCP directory's metadata),
    which the committing rank writes from every rank's part; True. Else False (the caller writes it)."""
    sealer, rel = _sealing(path, sealer)
    if sealer is None or rel is None:
        return False
    sealer.parts[rel] = part
    return True


@contextmanager
def sealing(root: Path) -> Iterator[Sealer]:
    """A :class:`Sealer` for the files written under ``root`` (``session.SaveSession.sealing`` hands it to the
    writers), closed at the end."""
    sealer = Sealer(Path(root).absolute())
    try:
        yield sealer
    finally:
        sealer.close()


class _AppendingWriter:
    """What ``torch.save`` and DCP write into under an active :class:`Sealer`: it only appends, hashes the bytes
    as they pass and hands them to a :class:`~impel.checkpoint.io.direct_io.DirectFile` (written around the page
    cache on an I/O thread while later bytes are still being serialized)."""

    def __init__(self, sealer: Sealer, path: Path, rel: str) -> None:
        self.sealer, self.path, self.rel = sealer, path, rel
        self.file = DirectFile(path)
        self.hasher = hashing.BlockHasher()
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        self.hasher.update(view)
        return self.file.write(view)

    def tell(self) -> int:
        return self.file.tell()

    def fileno(self) -> int:
        return self.file.fileno()

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        """Record the digests and queue the rest of the write, its fsync and the close. Idempotent."""
        if self.closed:
            return
        self.closed = True
        entry = manifest_entry(self.file.tell(), self.hasher.finish())
        self.sealer.add(self.rel, entry, self.sealer.sync(self.file.finish))

    def abort(self) -> None:
        """The writer failed: wait for the write in flight, then close (unless close() already handed it over)."""
        if self.closed:
            return
        self.closed = True
        self.file.abort()


@contextmanager
def appending(path: Path, sealer: Sealer | None) -> Iterator[Any]:
    """A write-only, append-only file (``write``, ``tell``, ``flush``, ``fileno``, ``close``) for ``torch.save`` and
    DCP: sealed in the background with ``sealer`` (the save's), else fsynced before the block ends."""
    sealer, rel = _sealing(path, sealer)
    if sealer is None or rel is None:
        file = DirectFile(Path(path))
        try:
            yield file
        except BaseException:
            file.abort()
            raise
        file.finish()
        return
    writer = _AppendingWriter(sealer, Path(path).absolute(), rel)
    try:
        yield writer
    except BaseException:
        writer.abort()
        raise
    writer.close()


def share_digests(root: Path, known: list[dict[str, Entry]], shared_dir: bool,
                  group: ProcessGroup | None = None) -> dict[str, Entry]:
    """Collective: every rank's known digests (``known``, in rank order, gathered by the caller with the write's
    outcome), plus those of the files nobody hashed yet, whose 64 MiB blocks are dealt round-robin to the ranks
    (each rank also fsyncs the files it read). Every returned file is fsynced.

    ``shared_dir``: all ranks see the same directory (otherwise each node commits its own copy and only this
    rank's entries are returned; the committer hashes the rest itself). ``group``: the process group (an
    asynchronous save's background group; default: the default group). Should the ranks list the directory
    differently, a file left out here is hashed by the committer (``layout.build_manifest``).
    """
    if not (is_distributed() and shared_dir):
        return join_ranges([known[dist.get_rank(group) if is_distributed() else 0]])
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    everyone: list[Any] = [None] * world
    merged = join_ranges(known)
    sizes = {p: p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()
             and p.relative_to(root).as_posix() not in merged and p.name not in (METADATA_FILE, MARKER_FILE)}
    units = [(path, i) for path, size in sizes.items() for i in range(hashing.block_count(size))]
    mine = units[rank::world]  # the same plan on every rank
    try:  # no raise between the collectives: a failure travels in the gathered payload to every rank
        digests = hashing.digest_blocks(mine)
        for path in {path for path, _ in mine}:
            fsync_file(path)
        payload: list[tuple[str, int, str]] | str = [(path.relative_to(root).as_posix(), i, d)
                                                     for (path, i), d in zip(mine, digests)]
        error: BaseException | None = None
    except OSError as exc:
        payload, error = f"{type(exc).__name__}: {exc}", exc
    dist.all_gather_object(everyone, payload, group=group)
    if error is not None:
        raise error
    blocks: dict[str, dict[int, str]] = {}
    for r, part in enumerate(everyone):
        if isinstance(part, str):
            raise CheckpointError(f"checksumming the checkpoint failed on rank {r} ({part})")
        for rel, i, digest in part:
            blocks.setdefault(rel, {})[i] = digest
    for path, size in sizes.items():
        rel = path.relative_to(root).as_posix()
        got = blocks.get(rel, {})
        if len(got) == hashing.block_count(size):
            merged[rel] = manifest_entry(size, [got[i] for i in range(len(got))])
    return merged
