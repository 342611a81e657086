"""Storage failures of ``save_state`` as one line naming the path the user gave: a full disk, a read-only target.

Before anything is written the leader checks that the target's filesystem is not mounted read-only and has room
for the model and optimizer state (:func:`check_room`). A failure while creating or writing (a directory without
write permission, a disk that fills up: the estimate is a lower bound, and other processes write too) is
translated by :func:`translated`: torch reports a full disk as
``RuntimeError: [enforce fail at inline_container.cc:672] unexpected pos ...`` with the ``ENOSPC`` only in its
chained cause, and a read-only filesystem names impel's hidden temporary directory. Both become an ``OSError``
with the original errno (``[Errno 28]`` for a full disk) whose message names the directory given to ``save_state``,
the bytes needed and the bytes free. The save sequence (``impel.accelerator.save_load``) keeps what it did
already: the temporary directory is deleted and the previous checkpoint at that path stays the newest complete one.
"""
from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch

NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})
READ_ONLY = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})


def _tensor_bytes(value: object) -> int:
    if not isinstance(value, torch.Tensor):
        return 0
    numel = getattr(value, "ds_numel", None)  # a DeepSpeed ZeRO-3 partitioned parameter holds an empty tensor
    return int(numel if numel is not None else value.numel()) * value.element_size()


def state_bytes(models: Iterable[torch.nn.Module], optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """The bytes of the model parameters and buffers (tied ones once) and the optimizer state tensors: a lower
    bound of a checkpoint's size (sharded tensors count with their global size, what all ranks write together)."""
    total = 0
    for model in models:
        total += sum(_tensor_bytes(p) for p in model.parameters())
        total += sum(_tensor_bytes(b) for b in model.buffers())
    for optimizer in optimizers:
        states = getattr(optimizer, "state", None)
        for state in states.values() if isinstance(states, Mapping) else ():
            total += sum(_tensor_bytes(v) for v in state.values()) if isinstance(state, Mapping) else 0
    return total


def existing_ancestor(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (what a save to ``path`` writes into)."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def tree_bytes(path: Path) -> int:
    """The bytes of the files under ``path`` (0 when it does not exist)."""
    if not path.is_dir():
        return 0
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _ours(error: OSError) -> OSError:
    error.impel_storage = True  # type: ignore[attr-defined]  # translated already: :func:`translated` passes it on
    return error


def no_space(final: Path, needed: int, free: int) -> OSError:
    return _ours(OSError(errno.ENOSPC, f"no space left on {final}: the checkpoint needs {needed:,} bytes (at least), "
                                 f"{free:,} free; free space on that filesystem or save_state to another one (the "
                                 "previous checkpoint there, if any, is kept)"))


def read_only(final: Path, where: Path, code: int, reason: str) -> OSError:
    return _ours(OSError(code, f"{final} is read-only ({where}: {reason}); save_state needs to write there: pass "
                               "a writable directory or fix its permissions (the previous checkpoint there, if any, "
                               "is kept)"))


def check_room(final: Path, needed: int) -> None:
    """Before a save to ``final``: its filesystem must not be mounted read-only and must hold ``needed`` bytes (the
    previous checkpoint there stays until the new one is committed, so it does not count as free). Permissions
    are not guessed (``os.access`` misjudges ACLs and network filesystems): a directory the save may not write
    fails at its first ``mkdir``, which :func:`translated` names."""
    where = existing_ancestor(final.parent)
    if _read_only_mount(where):
        raise read_only(final, where, errno.EROFS, os.strerror(errno.EROFS))
    free = shutil.disk_usage(where).free
    if free < needed:
        raise no_space(final, needed, free)


def _read_only_mount(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _os_error(exc: BaseException) -> OSError | None:
    """The first OSError with an errno in ``exc``'s chain (torch wraps the disk's error in a RuntimeError)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in NO_SPACE | READ_ONLY:
            return current
        current = current.__cause__ or current.__context__
    return None


def storage_error(exc: BaseException, final: Path, temp: Path, needed: Callable[[], int]) -> OSError | None:
    """The one-line error for a full or read-only target behind ``exc``, or None when ``exc`` is something else."""
    if getattr(exc, "impel_storage", False):
        return None
    cause = _os_error(exc)
    if cause is None:
        return None
    where = existing_ancestor(final.parent)
    if cause.errno in NO_SPACE:  # what was free before this save: the free space now plus what it wrote
        return no_space(final, needed(), shutil.disk_usage(where).free + tree_bytes(temp))
    assert cause.errno is not None
    return read_only(final, where, cause.errno, os.strerror(cause.errno))


@contextmanager
def translated(final: Path, temp: Path, needed: Callable[[], int]) -> Iterator[None]:
    """Re-raise a full disk or a read-only target met inside as the one-line ``OSError`` naming ``final``."""
    try:
        yield
    except Exception as exc:
        error = storage_error(exc, final, temp, needed)
        if error is None:
            raise
        raise error from None
