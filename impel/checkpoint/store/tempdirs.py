"""A save's temporary directory: created for this save only, and told from another live save's when cleaning.

**Created, never adopted.** Each rank creates the directory or, when another rank of the same save made it first,
joins it, but only a real directory owned by this user: a symlink or another user's directory planted at the name
(a shared, sticky parent) refuses the save instead of receiving its files. Names are unpredictable
(``staging.temp_token``: a keyed hash of the save's count with a secret the job's ranks share).

**Held while in use.** Every rank holds a shared ``flock`` on ``.impel-lock`` inside the directory while it writes;
the committer removes the file before sealing. A leftover is removed only when provably dead: its lock can be taken
(no process of any job holds it: the save crashed), or it has no lock and has not changed for
:data:`STALE_S` seconds (an earlier impel's, or a directory so new its lock is not there yet). A swapped-out copy
(``.impel-old-``, between the two renames of a replacement) is removed once :data:`OLD_STALE_S` seconds old. So an
evaluation job loading ``checkpoint_3`` while training saves ``checkpoint_4``, or two runs saving sibling
directories, never delete each other's save in flight.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import stat
import time
from pathlib import Path

from impel.checkpoint.errors import CheckpointError

logger = logging.getLogger("impel")

LOCK_NAME = ".impel-lock"
STALE_S = 3600.0  # a temporary directory without a lock, untouched this long, is an interrupted save's
OLD_STALE_S = 60.0  # a swapped-out copy lives between two renames: this old, it is a crashed swap's leftover
_held: dict[str, int] = {}  # this process's lock descriptors, by temporary directory


def make(temp: Path) -> None:
    """Create ``temp`` (or join it: another rank of this save created it) and hold its lock."""
    temp.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        temp.mkdir()
    st = os.lstat(temp)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        what = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory this user owns"
        raise CheckpointError(f"{temp}, the temporary directory of this save, already exists and is {what}; impel "
                              "writes a checkpoint only into a directory it created: nothing was written. Remove it, "
                              "and save where other users cannot create files")
    for other in [t for t in _held if t != str(temp)]:  # earlier saves of this process have ended
        release(Path(other), unlink=False)
    if str(temp) not in _held:
        try:
            fd = os.open(temp / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except FileNotFoundError:
            raise CheckpointError(f"{temp}, the temporary directory of this save, was removed while this rank "
                                  "joined it (another rank's save failed, or another process cleaned it): nothing "
                                  "was committed; save again") from None
        fcntl.flock(fd, fcntl.LOCK_SH)
        _held[str(temp)] = fd


def release(temp: Path, unlink: bool = True) -> None:
    """Stop holding ``temp``'s lock; ``unlink``: remove the lock file (the committer, before sealing)."""
    if unlink:
        (temp / LOCK_NAME).unlink(missing_ok=True)
    fd = _held.pop(str(temp), None)
    if fd is not None:
        os.close(fd)


def clean(root: Path, keep: Path | None, prefixes: tuple[str, str]) -> list[Path]:
    """Remove the provably dead leftovers in ``root`` (see the module docstring); returns them."""
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    tmp_prefix, old_prefix = prefixes
    for entry in root.iterdir():
        if not entry.name.startswith(prefixes) or entry == keep or entry.is_symlink() or not entry.is_dir():
            continue
        if str(entry) in _held:  # an earlier save of this process, ended: not a live one
            release(entry, unlink=False)
        why = _dead_old(entry) if entry.name.startswith(old_prefix) else _dead_temp(entry)
        if why is None:
            logger.debug("leaving %s: a save in flight may be using it", entry)
            continue
        logger.warning("removing %s, left by an interrupted save (%s)", entry, why)
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


def _dead_temp(entry: Path) -> str | None:
    try:
        fd = os.open(entry / LOCK_NAME, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        age = time.time() - os.lstat(entry).st_mtime
        return f"no lock, untouched for {age:.0f} s" if age > STALE_S else None
    except OSError:
        return None  # a lock we cannot open (another user's): not ours to judge
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return None
    finally:
        os.close(fd)
    return "no process holds its lock"


def _dead_old(entry: Path) -> str | None:
    age = time.time() - os.lstat(entry).st_ctime
    return f"swapped out {age:.0f} s ago" if age > OLD_STALE_S else None
