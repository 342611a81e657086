"""Checksums for the manifest, computed while the checkpoint is being written instead of after it.

* :class:`Sealer` and :func:`appending`: files written front to back (``torch.save``'s, DCP's shards, impel's
  safetensors files) go through an append-only file object that hashes the bytes as they pass (XXH3 runs at
  memory speed: no pass of its own) while the finished blocks are flushed to disk with ``fdatasync`` on an I/O
  thread and later blocks are still being serialized.
* :func:`share_digests`: files nobody hashed yet (DCP's metadata, DeepSpeed's engine files, the cooperative full
  files written at scattered offsets by every rank, files of a ``register_save_state_pre_hook``) have their blocks
  dealt round-robin to the ranks.

The committing rank receives every digest and only hashes what is still unknown (see ``layout.build_manifest``).
"""
from __future__ import annotations

import contextvars
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist

from impel.checkpoint import hashing
from impel.checkpoint.layout import (
    MARKER_FILE,
    METADATA_FILE,
    CheckpointError,
    fsync_file,
    manifest_entry,
)
from impel.runtime.collectives import is_distributed

Entry = dict[str, Any]  # layout.manifest_entry: {"size": int, "xxh3_128_blocks": [str, ...]}
_current: contextvars.ContextVar[Sealer | None] = contextvars.ContextVar("impel_sealer", default=None)


class Sealer:
    """Collects the digests of the files written under ``root`` (hashed as they were written) and fsyncs them on
    I/O threads; :meth:`entries` waits for all of it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        # several at once: fsyncs of different files overlap and share the filesystem's journal commits
        self._sync_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="impel-fsync")
        self._pending: dict[str, tuple[int, Callable[[], list[str]], Future[Any]]] = {}
        self.parts: dict[str, Any] = {}  # files the committer writes from every rank's part (``contribute``)

    def relative(self, path: Path) -> str | None:
        try:
            return Path(path).absolute().relative_to(self.root).as_posix()
        except ValueError:
            return None

    def add(self, rel: str, size: int, blocks: Callable[[], list[str]], synced: Future[Any]) -> None:
        self._pending[rel] = (size, blocks, synced)

    def sync(self, fn: Any, *args: Any) -> Future[Any]:
        return self._sync_pool.submit(fn, *args)

    def entries(self) -> dict[str, Entry]:
        """Every queued file's manifest entry (relative posix path -> entry); raises what hashing or fsync raised."""
        out = {}
        for rel, (size, blocks, synced) in self._pending.items():
            synced.result()
            out[rel] = manifest_entry(size, blocks())
        return out

    def close(self) -> None:
        self._sync_pool.shutdown(wait=True)


def contribute(path: Path, part: Any) -> bool:
    """Under an active :class:`Sealer`: this rank's ``part`` of the file ``path`` (a DCP directory's metadata),
    which the committing rank writes from every rank's part; True. Else False (the caller writes it)."""
    sealer = _current.get()
    rel = sealer.relative(path) if sealer is not None else None
    if sealer is None or rel is None:
        return False
    sealer.parts[rel] = part
    return True


@contextmanager
def sealing(root: Path) -> Iterator[Sealer]:
    """While active, files that impel's writers finish under ``root`` are sealed in the background."""
    sealer = Sealer(Path(root).absolute())
    token = _current.set(sealer)
    try:
        yield sealer
    finally:
        _current.reset(token)
        sealer.close()


class _AppendingWriter:
    """What ``torch.save`` and DCP write into under an active :class:`Sealer`: it only appends, and hashes the
    bytes as they pass; whenever another 64 MiB block is done the file is flushed to disk in the background while
    later blocks are still being serialized."""

    def __init__(self, sealer: Sealer, path: Path, rel: str) -> None:
        self.sealer, self.path, self.rel = sealer, path, rel
        self.file = open(path, "wb")  # noqa: SIM115 - closed in close()
        self.offset = 0
        self.hasher = hashing.BlockHasher()
        self.flushing: Future[Any] | None = None
        self.closed = False

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.file.write(view)
        self.hasher.update(view)
        before, self.offset = self.offset, self.offset + view.nbytes
        if self.offset // hashing.BLOCK > before // hashing.BLOCK and (self.flushing is None or self.flushing.done()):
            self.file.flush()
            self.flushing = self.sealer.sync(os.fdatasync, self.file.fileno())
        return view.nbytes

    def tell(self) -> int:
        return self.offset

    def fileno(self) -> int:
        return self.file.fileno()

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        """Record the digests and queue the final fsync; the file is closed after it. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.file.flush()
        digests = self.hasher.finish()
        self.sealer.add(self.rel, self.offset, lambda: digests, self.sealer.sync(_sync_and_close, self.file))

    def abort(self) -> None:
        """The writer failed: wait for a running fdatasync, then close (unless close() already handed it over)."""
        if self.closed:
            return
        self.closed = True
        if self.flushing is not None:
            self.flushing.result()
        self.file.close()


def _sync_and_close(file: Any) -> None:
    try:
        os.fsync(file.fileno())
    finally:
        file.close()


@contextmanager
def appending(path: Path) -> Iterator[Any]:
    """A write-only, append-only file (``write``, ``tell``, ``flush``, ``fileno``, ``close``) for ``torch.save`` and
    DCP: sealed in the background under an active :class:`Sealer`, else fsynced before the block ends."""
    sealer = _current.get()
    rel = sealer.relative(path) if sealer is not None else None
    if sealer is None or rel is None:
        with open(path, "wb") as f:
            yield f
        fsync_file(path)
        return
    writer = _AppendingWriter(sealer, Path(path).absolute(), rel)
    try:
        yield writer
    except BaseException:
        writer.abort()
        raise
    writer.close()


def share_digests(root: Path, known: list[dict[str, Entry]], shared_dir: bool, group: Any = None) -> dict[str, Entry]:
    """Collective: every rank's known digests (``known``, in rank order, gathered by the caller with the write's
    outcome), plus those of the files nobody hashed yet, whose 64 MiB blocks are dealt round-robin to the ranks
    (each rank also fsyncs the files it read). Every returned file is fsynced.

    ``shared_dir``: all ranks see the same directory (otherwise each node commits its own copy and only this
    rank's entries are returned; the committer hashes the rest itself). ``group``: the process group (an
    asynchronous save's background group; default: the default group). Should the ranks list the directory
    differently, a file left out here is hashed by the committer (``layout.build_manifest``).
    """
    if not (is_distributed() and shared_dir):
        return dict(known[dist.get_rank(group) if is_distributed() else 0])
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    everyone: list[Any] = [None] * world
    merged: dict[str, Entry] = {}
    for entries in known:
        merged.update(entries)
    sizes = {p: p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()
             and p.relative_to(root).as_posix() not in merged and p.name not in (METADATA_FILE, MARKER_FILE)}
    units = [(path, i) for path, size in sizes.items() for i in range(hashing.block_count(size))]
    mine = units[rank::world]  # the same plan on every rank
    try:  # no raise between the collectives: a failure travels in the gathered payload to every rank
        digests = hashing.digest_blocks(mine)
        for path in {path for path, _ in mine}:
            fsync_file(path)
        payload: Any = [(path.relative_to(root).as_posix(), i, d) for (path, i), d in zip(mine, digests)]
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
