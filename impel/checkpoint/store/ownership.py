"""What in a checkpoint directory is the checkpoint's, and what is the user's: nothing a user wrote may vanish.

A complete impel checkpoint owns the files its manifest lists, plus ``impel_checkpoint.json`` and ``COMPLETE``.
Anything else in the directory (``notes.txt``, ``eval/results.json``) is the user's: a new ``save_state`` into the
same path carries it into the new checkpoint (hard links made before the swap, so that it exists under the final
name at every moment, whatever crashes), as Accelerate, which writes into the directory, keeps it.

Rotation (``total_limit``, the Trainer's ``save_total_limit``) deletes what an old checkpoint owns and keeps the
directory when anything else is left in it, with one log line naming what was kept (Accelerate deletes the whole
directory).

Our other writers (``merge-weights``, ``save_model``) refuse an output directory inside a checkpoint: their files
would sit outside its manifest, looking like the user's, mixed with the checkpoint's.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
from pathlib import Path

from impel.checkpoint.store.layout import MARKER_FILE, METADATA_FILE, CheckpointError, is_complete, read_metadata

logger = logging.getLogger("impel")


def owned_files(directory: Path) -> set[str]:
    """The relative posix paths a complete checkpoint owns; a CheckpointError naming the fix when its metadata
    cannot be read (the user's files cannot then be told from the checkpoint's)."""
    try:
        files = read_metadata(directory)["files"]
    except CheckpointError as exc:
        raise CheckpointError(f"save_state output_dir {directory} is a damaged impel checkpoint, so its files "
                              f"cannot be told from yours ({exc}); move the files you want to keep out of it and "
                              "delete it, or pass another directory") from None
    return set(files) | {METADATA_FILE, MARKER_FILE}


def user_entries(directory: Path, owned: set[str]) -> list[str]:
    """The fewest relative paths under ``directory`` that hold everything the checkpoint does not own: a folder
    with nothing owned inside is one entry; a folder holding owned files is looked into."""
    owned_dirs = {Path(rel).parent.as_posix() for rel in owned}
    owned_dirs |= {p.as_posix() for rel in owned_dirs for p in Path(rel).parents}
    found: list[str] = []

    def walk(folder: Path) -> None:
        for entry in sorted(folder.iterdir()):
            rel = entry.relative_to(directory).as_posix()
            if entry.is_dir() and not entry.is_symlink() and rel in owned_dirs:
                walk(entry)
            elif rel not in owned:
                found.append(rel)

    walk(directory)
    return found


def carry_user_files(old: Path, new: Path) -> list[str]:
    """Link (or copy, where links are not possible) the user's files of checkpoint ``old`` into ``new``, the
    sealed temporary directory about to replace it. Refuses, before anything is touched, when the new checkpoint
    writes a file at the same path. Returns the paths carried."""
    entries = user_entries(old, owned_files(old))
    clashes = [rel for rel in entries if (new / rel).exists() or (new / rel).is_symlink()]
    if clashes:
        raise CheckpointError(f"save_state output_dir {old} holds {clashes[0]!r}, which is not part of the "
                              "checkpoint there but is a file the new checkpoint writes; move it out of the "
                              "directory (or save elsewhere): nothing was changed")
    for rel in entries:
        source, target = old / rel, new / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir() and not source.is_symlink():
            shutil.copytree(source, target, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(str(source), str(target))
    return entries


def remove_checkpoint(directory: Path, why: str) -> list[str]:
    """Rotation: delete the files the complete checkpoint ``directory`` owns; the directory goes too unless
    something the checkpoint does not own is in it (the user's), which stays, named in one log line. ``why`` is
    the setting that rotates (``total_limit=2``). Returns the kept paths (relative to ``directory``)."""
    try:
        owned = owned_files(directory)
    except CheckpointError as exc:
        logger.warning("%s: not deleting %s: %s", why, directory, exc)
        return []
    kept = user_entries(directory, owned)
    if not kept:
        logger.info("%s: deleting %s", why, directory)
        shutil.rmtree(directory, ignore_errors=True)
        return []
    (directory / MARKER_FILE).unlink(missing_ok=True)  # first: from here on it is no longer a checkpoint
    for rel in sorted(owned):
        (directory / rel).unlink(missing_ok=True)
    folders = {p for rel in owned for p in (directory / rel).parents if directory in p.parents}
    for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):  # not empty: it holds a file of the user's
            folder.rmdir()
    logger.info("%s: deleted the checkpoint files of %s but kept the directory, which holds what the checkpoint "
                "does not own: %s", why, directory, ", ".join(kept))
    return kept


def _link_or_copy(source: str, target: str) -> None:
    if os.path.islink(source):
        os.symlink(os.readlink(source), target)
        return
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def check_save_target(final: Path) -> None:
    """Before a ``save_state`` writes anything: the user's files of an existing checkpoint at ``final`` can be told
    from its own, and ``final`` is not nested in another checkpoint."""
    if is_complete(final):
        owned_files(final)
    refuse_inside_checkpoint(final, "save_state output_dir", parents_only=True)


def refuse_inside_checkpoint(path: str | os.PathLike[str], what: str, parents_only: bool = False) -> None:
    """A CheckpointError when ``path`` is an impel checkpoint or lies inside one: ``what`` names the writer."""
    target = Path(path).absolute()
    for folder in target.parents if parents_only else (target, *target.parents):
        if folder.is_dir() and is_complete(folder):
            raise CheckpointError(f"{what} {path} is inside the impel checkpoint {folder}; its files would be "
                                  "mixed with the checkpoint's (which a later save_state there replaces): pass a "
                                  "directory outside it")
