"""One save, passed down explicitly: :class:`SaveSession`.

``save_state`` creates the session and hands it to the strategy (``Strategy.save_checkpoint``) and every writer
(``files.write_torch`` / ``write_safetensors``, ``full.save_full``, ``sharded.save_sharded``,
``registered.write_registered``, the DCP writer in ``dcp_raw``). It holds what a writer needs to know about the save
it writes for, instead of ambient state:

* ``directory``: the temporary directory being filled (committed to ``final`` at the end), ``leader``: whether this
  rank writes the replicated files, ``group``: the process group of the save's collectives (an asynchronous save's
  background group, None for the default one);
* the **mode**: a synchronous save writes at once; an asynchronous one, while it stages (:meth:`staging`), records
  every write with its state copied to CPU memory, and the background job replays them later;
* the **sealer** while the files are written (:meth:`sealing`): each file is hashed as written and fsynced in the
  background (``digests``), and its digest goes into the manifest.

A writer writes through :meth:`write` (``session.write(fn, state, *args)``: ``fn(session, state, *args)`` now, or
recorded with ``state`` staged); the file primitives (:meth:`open`, :meth:`finish_ranges`, :meth:`contribute`)
refuse to run while the session stages, so a writer that bypasses :meth:`write` fails the save at once with a
CheckpointError naming the file, never writes synchronously in the middle of an asynchronous save. Every writer
takes the session as its first, required parameter: a writer called without one fails to type-check.

``SaveSession.plain()`` is the session of a write outside ``save_state`` (``save_model``, ``merge_weights``): files
written at once and fsynced, no manifest.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from impel.checkpoint.io import digests
from impel.checkpoint.io.direct_io import DirectFile
from impel.checkpoint.saving.staging import Deferred
from impel.checkpoint.store.layout import CheckpointError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.checkpoint.metadata import Metadata

    from impel.checkpoint.saving.stager import Stager

__all__ = ["SaveSession"]


class SaveSession:
    """One ``save_state`` on this rank (see the module docstring)."""

    def __init__(self, directory: Path | None, final: Path | None = None, *, leader: bool = True,
                 group: ProcessGroup | None = None) -> None:
        self.directory = Path(directory) if directory is not None else None
        self._final = final
        self.leader = leader
        self.group = group
        self.metadata: dict[str, object] = {}  # the checkpoint's metadata, taken when the save is called
        self._staged: Deferred | None = None  # an asynchronous save while it stages: writes are recorded
        self._sealer: digests.Sealer | None = None  # while the files are written: hashed, fsynced in the background

    @classmethod
    def plain(cls) -> SaveSession:
        """Writes outside ``save_state``: at once, each file fsynced, nothing sealed."""
        return cls(None)

    @property
    def checkpoint_dir(self) -> Path:
        """The directory the save fills (a plain session has none: a checkpoint writer refuses it)."""
        if self.directory is None:
            raise CheckpointError("a checkpoint writer got a plain write session; pass the save_state session")
        return self.directory

    @property
    def final(self) -> Path:
        """Where the checkpoint is committed (for a URL: its local staging directory)."""
        return self._final if self._final is not None else self.checkpoint_dir

    # --- the mode ---------------------------------------------------------------------------------------------
    @property
    def is_staging(self) -> bool:
        return self._staged is not None

    @contextmanager
    def staging(self, stager: Stager) -> Iterator[Deferred]:
        """An asynchronous save's call: :meth:`write` records each write, its state staged by ``stager``; the
        yielded :class:`~impel.checkpoint.saving.staging.Deferred` replays them (on the background thread)."""
        if self._staged is not None or self._sealer is not None:
            raise CheckpointError("a save session stages once, before its files are written")
        self._staged = Deferred(stager)
        try:
            yield self._staged
        finally:
            self._staged = None

    @contextmanager
    def sealing(self) -> Iterator[digests.Sealer]:
        """While the files are written: each one under ``directory`` is hashed as written and fsynced in the
        background; the yielded sealer's ``entries()`` gives their digests."""
        with digests.sealing(self.checkpoint_dir) as sealer:
            self._sealer = sealer
            try:
                yield sealer
            finally:
                self._sealer = None

    # --- writing ----------------------------------------------------------------------------------------------
    def write(self, fn: Callable[..., None], state: object, *args: object, **kwargs: object) -> None:
        """``fn(self, state, *args, **kwargs)`` now; while staging, ``state`` copied to CPU memory now and the
        call recorded (replayed by the background job with the staged copy)."""
        if self._staged is not None:
            self._staged.record(functools.partial(fn, self), state, *args, **kwargs)
            return
        fn(self, state, *args, **kwargs)

    def _writing(self, path: Path) -> digests.Sealer | None:
        """The save's sealer (``digests`` writes a file outside its directory plainly); refuses while the session
        stages."""
        if self._staged is not None:
            raise CheckpointError(f"{path} was written while an asynchronous save staged its state: every writer of "
                                  "a save goes through SaveSession.write (impel.checkpoint.saving.session), which "
                                  "stages the state now and writes it in the background")
        return self._sealer

    def open(self, path: Path) -> AbstractContextManager[Any]:  # torch.save wants IO[bytes]; these only append
        """An append-only file for ``torch.save`` and DCP (``digests.appending``): sealed in the background during
        the save, else fsynced before the block ends."""
        return digests.appending(path, self._writing(path))

    def finish_ranges(self, file: DirectFile, size: int, ranges: list[tuple[int, int, str]]) -> None:
        """This rank's byte ranges of a file several ranks write (``cooperative``): ``digests.finish_ranges``."""
        digests.finish_ranges(file, size, ranges, self._writing(file.path))

    def contribute(self, path: Path, part: Metadata) -> bool:
        """This rank's part of a file the committing rank writes from every rank's (a DCP directory's metadata);
        False outside a sealed save (the caller writes the file)."""
        return digests.contribute(path, part, self._writing(path))

    def settle(self, path: Path) -> None:
        """Wait until ``path``, if this save wrote it, is wholly on disk (a read-back during the save)."""
        digests.settle(path, self._sealer)
