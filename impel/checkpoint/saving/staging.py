"""Asynchronous ``save_state``: the state staged in CPU memory at call time, written by one background thread.

``save_state(async_save=True)`` runs the ordinary save sequence (``accelerator/save_load.py``) with its
:class:`~impel.checkpoint.saving.session.SaveSession` staging: every write a writer does through
``SaveSession.write`` (``files.write_torch``, ``files.write_safetensors``, DCP's ``save`` in ``sharded``, ...) is
recorded in a :class:`Deferred` instead, with its state copied to CPU memory by
:class:`~impel.checkpoint.saving.stager.Stager` (pinned memory where CUDA exists, a plain copy on the CPU, where
training then changes the parameters in place; its buffers are reused from one save to the next). The call returns
once every rank has staged. :class:`PendingSave` then replays the recorded writes on a background thread, in the order
they were recorded, followed by the rest of the synchronous sequence (digests, the leader's commit).

Collectives of that background part (DCP's planning, the shared errors, the digest exchange, the commit's
agreement) run on a dedicated gloo group (:func:`background_group`), created collectively on the default group
inside the first asynchronous ``save_state``: training's collectives on the default group never interleave with
them, and since only background threads take part in the dedicated group, a rank whose main thread is busy
elsewhere (or already waiting for the save) cannot block another's write. At most one save is pending per
process: the next ``save_state`` / ``load_state`` / ``end_training`` waits for it first, and so does the end of
the script (an exit hook of ``threading``, which runs before ``atexit``).
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import itertools
import secrets
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from impel.checkpoint.saving.stager import Stager, rewrapped
from impel.checkpoint.store.layout import CheckpointError
from impel.runtime.ranks.collectives import is_distributed

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

R = TypeVar("R")


class Deferred:
    """The writes one ``save_state`` recorded instead of doing them, each with its state already staged, and the
    checkpoint metadata taken at the call (``SaveSession.staging``)."""

    def __init__(self, stager: Stager) -> None:
        self.stager = stager
        self.writes: list[Callable[[], object]] = []
        self.metadata: dict[str, object] = {}
        self.error: BaseException | None = None  # staging failed on this rank (``Checkpointer._stage``)

    def record(self, fn: Callable[..., object], state: object, *args: object, **kwargs: object) -> None:
        """``fn(staged state, *args, **kwargs)`` recorded, ``state`` staged now."""
        # the write's position in the save keys its buffers: the next save of the same layout reuses them
        # DTensors are wrapped again on the background thread (rewrapped), not on the caller's critical path
        staged = self.stager.stage(state, key=len(self.writes), rewrap=False) if state is not None else None
        self.writes.append(functools.partial(_rewrapped_call, fn, staged, args, kwargs))

    def run(self) -> dict[str, object]:
        """Do the recorded writes in order (on the background thread; the staged copies are dropped as they go);
        the checkpoint metadata."""
        while self.writes:
            self.writes.pop(0)()
        return self.metadata


def _rewrapped_call(fn: Callable[..., R], staged: object, args: tuple[object, ...], kwargs: dict[str, object]) -> R:
    return fn(rewrapped(staged), *args, **kwargs)


def new_stager() -> Stager:
    """CPU copies (pinned where CUDA exists) into buffers reused from one save to the next (``stager``)."""
    return Stager(pin_memory=torch.cuda.is_available())


# --- the dedicated process group -------------------------------------------------------------------------------
_group: list[Any] = []  # [default group, its gloo group for background saves, the job's token] once created
_saves = itertools.count()  # this process's asynchronous saves: the same count on every rank (all of them call)


def group_ready() -> bool:
    """Whether :func:`background_group` returns without a collective (one process, or the group exists)."""
    return not is_distributed() or bool(_group and _group[0] is dist.distributed_c10d._get_default_group())


def background_group(timeout: timedelta) -> ProcessGroup | None:
    """The gloo group background saves coordinate on (None on one process). Collective on the default group the
    first time (and after the default group changed): every rank calls it at the same point of ``save_state``.
    It also agrees a random 128-bit secret for the job there, from which :func:`temp_token` names the saves'
    directories."""
    if not is_distributed():
        return None
    if not group_ready():
        token = [secrets.token_hex(16)]  # the job's secret: names are keyed hashes of it (temp_token), never it
        dist.broadcast_object_list(token, src=0)
        _group[:] = [dist.distributed_c10d._get_default_group(), dist.new_group(backend="gloo", timeout=timeout),
                     token[0]]
    return _group[1]


def temp_token() -> str:
    """The token of the next asynchronous save's temporary directory (``layout.temp_dir_for``): the same on every
    rank without a collective (a keyed hash of the count of this process's asynchronous saves, with the job's secret
    from :func:`background_group`: one save's name does not tell the next one's), and new for every save of every
    job: a crashed job's leftover is never reused, and a
    retry never shares a directory with a failed save whose leader may still be removing it. Should the ranks'
    counts differ, the background job's agreement names the directories and fails the save. Random on one
    process."""
    n = next(_saves)
    if _group and is_distributed():  # unpredictable to whoever watches the names (tempdirs: no planted symlink)
        return hmac.new(_group[2].encode(), str(n).encode(), hashlib.sha256).hexdigest()[:24]
    return secrets.token_hex(12)


def release_group() -> None:
    """Forget the dedicated group (the default group's destruction destroys it): its gloo threads can then be joined
    at exit (:mod:`impel.runtime.ranks.teardown`)."""
    _group.clear()


# --- the background write --------------------------------------------------------------------------------------
class PendingSave:
    """One save being written on a background thread; :meth:`wait` joins it and raises what it raised."""

    def __init__(self, final: str, job: Callable[[], None], reported: BaseException | None = None) -> None:
        self.final = final
        self.error: BaseException | None = None
        self.reported = reported  # raised at the call already (staging failed on this rank): not raised again
        # a script that ends right after save_state still leaves the complete checkpoint: _wait_at_exit joins it
        # (and reports a failure); not a daemon, so nothing ends it halfway
        self.thread = threading.Thread(target=self._run, args=(job,), name="impel-async-save", daemon=False)
        _pending.add(self)
        _register_exit_wait()
        self.thread.start()

    def _run(self, job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as exc:  # noqa: BLE001 - kept for wait(), raised on the caller's thread
            self.error = exc

    def done(self) -> bool:
        return not self.thread.is_alive()

    def wait(self) -> str | None:
        """Block until the save is committed; the checkpoint's path, or a CheckpointError naming it and the cause
        (None for a save whose failure the call raised already)."""
        self.thread.join()
        _pending.discard(self)
        if self.reported is not None:
            return None
        if self.error is not None:
            cause = self.error
            raise CheckpointError(
                f"the asynchronous save_state() to {self.final} failed: {type(cause).__name__}: {cause}. Nothing "
                "was committed there (the newest complete checkpoint is still the previous one); fix the cause "
                "and save again") from cause
        return self.final


_pending: set[PendingSave] = set()


_exit_wait_registered: list[bool] = []


def _register_exit_wait() -> None:
    # threading's exit hooks run when the main thread has finished, newest first and before concurrent.futures
    # refuses new work (the background write's hashing pools need it) and before any atexit handler (impel's
    # process-group teardown among them)
    if not _exit_wait_registered:
        threading._register_atexit(_wait_at_exit)  # type: ignore[attr-defined]
        _exit_wait_registered.append(True)


def _wait_at_exit() -> None:
    """At exit: finish every pending save (normally already joined by the interpreter) and report a failure."""
    for pending in list(_pending):
        try:
            pending.wait()
        except CheckpointError as exc:
            print(f"impel: {exc}", file=sys.stderr, flush=True)
    release_group()
